"""Compute ops the models call, behind one dispatch point.

`ops.<name>(...)` runs the implementation registered for the device of the first tensor
argument, falling back to the portable torch implementation. The models only ever call
`ops`, so a Triton (CUDA) version of an op is added by registering it, without touching
a model.
"""

# From the repository root this folder is also visible as a top-level `kernels`, the name
# transformers probes for the HF kernel-hub package on import; imported under that name it
# stays empty, so transformers finds no version there and `import transformers` works.
if __name__ == "vlmserve.kernels":
    from vlmserve.kernels.registry import ops, register

    # importing the modules registers their implementations
    from vlmserve.kernels import attention, gdn, linear, norms, rotary, sampling  # noqa: F401

    __all__ = ["ops", "register"]
