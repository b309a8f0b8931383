"""Compute ops the models call, behind one dispatch point.

`ops.<name>(...)` runs the implementation of the kernel table in use (an engine's, made
by `kernel_table` for its device), falling back to the portable torch implementation. The
models only ever call `ops`, so a Triton (CUDA) version of an op is added by registering
it, without touching a model.
"""

# From the repository root this folder is also visible as a top-level `kernels`, the name
# transformers probes for the HF kernel-hub package on import; imported under that name it
# stays empty, so transformers finds no version there and `import transformers` works.
if __name__ == "vlmserve.kernels":
    import sys

    from vlmserve import envs
    from vlmserve.kernels.registry import KernelTable, ops, register, use_kernels

    # importing the modules registers their implementations
    from vlmserve.kernels import (  # noqa: F401
        attention,
        decode_layers,
        gdn,
        linear,
        lora,
        norms,
        quantized_linear,
        rotary,
        sampling,
    )

    def kernel_table(device_type: str, triton: bool = False) -> KernelTable:
        """The ops for a device: CUDA runs the Triton kernels; the CPU its C++ ones, or
        with `triton` the Triton kernels under Triton's interpreter (the GPU path, checked
        on a machine without one), turned on here before they are first defined."""
        if device_type == "cuda" or triton:
            if device_type != "cuda" and not envs.TRITON_INTERPRET:
                if "vlmserve.kernels.triton_attention" in sys.modules:
                    raise RuntimeError("the Triton kernels were compiled for a GPU in this process: they cannot "
                                       "also run on CPU tensors here")
                envs.turn_on_triton_interpreter()
            from vlmserve.kernels import (  # noqa: F401
                triton_attention,
                triton_elementwise,
                triton_gdn,
                triton_lora,
                triton_quantized_linear,
            )
        return KernelTable(device_type, triton)

    __all__ = ["ops", "register", "kernel_table", "use_kernels", "KernelTable"]
