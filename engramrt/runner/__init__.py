"""Running one pipeline stage: the step message (``StepBatch``/``StepResult``), the ``Carry``
between stages, the ``StageRunner`` (layers, KV cache, hasher, sampler), its CUDA graphs, KV
sizing and the sampler."""
