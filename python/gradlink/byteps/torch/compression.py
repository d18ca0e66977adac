"""byteps.torch.compression on gradlink: the gradient compressors BytePS scripts pass to
push_pull, DistributedOptimizer and DistributedDataParallel (`Compression.none`,
`Compression.fp16`).

They are gradlink.torch's own classes (one implementation for both front ends): compress(tensor)
returns (tensor to send, context) and decompress(tensor, context) undoes it. fp16 sends
floating-point tensors as fp16, which gradlink's servers accumulate in fp32 and round once.
"""

from gradlink.torch._horovod import (  # noqa: F401
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
