"""Speed: the GPUs, each candidate's operand formats, the GEMM shapes, the predicted times."""
