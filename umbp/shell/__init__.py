"""The imperative shell vLLM talks to: connector facade, scheduler and worker roles."""
