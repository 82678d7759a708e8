"""Specialised decode kernels, each enabled only inside a scope its evidence covers.

Two kernels, each with a pure torch reference that runs on CPU:

- ``dcp_lse_combine``: merges the partial attention outputs and log-sum-exps of the decode
  context parallel (DCP) ranks into one output and its LSE.
- ``fused_add_rmsnorm``: residual add + RMSNorm, optionally quantising to FP8 e4m3.

Where things live:

- ``kernels.scope``      what each kernel claims to handle and the cases a validation run
                         covers (pure: no torch, cheap for the orchestrator to read)
- ``kernels.gate``       pure decision, per specialised path, whether an engine may use it
- ``kernels.reference``  torch references (also DCP-sharded attention, to test the combine)
- ``kernels.cute``       CuTe DSL sources; ``cutlass`` is imported only inside functions there
- ``kernels.compile``    compiles every kernel for every arch in scope, no GPU needed
- ``kernels.resources``  registers, spills, PTX target and instruction mix, read on a CPU
- ``kernels.launch``     loads a precompiled cubin and launches it on torch CUDA tensors
- ``kernels.ops``        torch-facing calls of the kernels through ``kernels.launch``
- ``kernels.validate``   correctness and timing on a GPU against the references
- ``kernels.evidence``   evidence files (JSON + Markdown), ``show`` and ``diff``
- ``kernels.cli``        ``kvtide kernels {validate,show,diff,compile}``
- ``kernels.vllm_plugin`` the ``vllm.general_plugins`` hook; inert unless asked for

See docs/kernels.md. Importing this package imports nothing heavy.
"""
