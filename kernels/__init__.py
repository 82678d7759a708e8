"""Specialised decode paths, each enabled only inside a scope that current evidence covers.

- ``fused_add_rmsnorm``: kvtide's CuTe kernel, residual add + RMSNorm, optionally
  quantising to FP8 e4m3; evidence from ``kvtide kernels validate``.
- ``kimi_k3_latency_specialized``: vLLM's own Kimi K3 path; evidence from an engine-level
  A/B (``kvtide kernels ab``).

Where things live:

- ``kernels.scope``      what each path claims to handle and the cases that check it (pure)
- ``kernels.gate``       pure decision, per path, whether an engine may use it
- ``kernels.sources``    the source digest and file hashes evidence is bound to
- ``kernels.coverage``   whether an evidence file is current and covers a validated scope
- ``kernels.reference``  the torch reference; ``kernels.emulate`` the kernel's order on CPU
- ``kernels.tolerance``  errors in steps of the output format, bounded by torch's own
- ``kernels.timing``     CUDA-graph timing and its statistics; ``kernels.baselines`` what
                         the engine runs instead
- ``kernels.cute``       CuTe DSL sources; ``cutlass`` is imported only inside functions there
- ``kernels.compile``    compiles every kernel for every arch in scope, no GPU needed
- ``kernels.resources``  registers, spills, PTX target and instruction mix, read on a CPU
- ``kernels.launch``     loads a precompiled cubin and launches it on torch CUDA tensors
- ``kernels.ops``        torch-facing calls of the kernels through ``kernels.launch``
- ``kernels.validate``   correctness and timing on a GPU against the references
- ``kernels.evidence``   evidence files (JSON + Markdown), ``show`` and ``diff``
- ``kernels.ab``         the engine-level A/B (pure); ``kernels.ab_run`` runs its engines
- ``kernels.cli``        ``kvtide kernels {validate,show,diff,compile,ab}``
- ``kernels.vllm_plugin`` the ``vllm.general_plugins`` hook; inert unless asked for

See docs/kernels.md. Importing this package imports nothing heavy.
"""
