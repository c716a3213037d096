"""TEST-ONLY CPU stand-ins for SGLang's CUDA-only pieces. Never for production use.

Put this directory on ``PYTHONPATH`` (``umbp.testing.sglang_engine`` does) and every
Python process started with it, SGLang's spawned schedulers included, gets:

* ``sgl_kernel``: an import-only stand-in (CUDA-only wheels on the registry); any of
  its names raises when called, and none is called on a CPU without AMX;
* ``sitecustomize``: once SGLang's host-pool modules are imported, host-memory pinning
  becomes a no-op (it needs an NVIDIA driver), the three "direct" host<->device KV
  transfer ops get pure-torch slice-copy versions (SGLang imports them only for
  CUDA/ROCm/XPU), the pinned page buffers of SGLang's generic storage path (its
  ``file`` backend) are allocated unpinned, and the fixed 10 GiB host-memory reserve is
  lowered.

Nothing installed is edited. umbp's SGLang backend (``umbp.sglang``) does not depend on
any of this: it is what GPU users run.
"""
