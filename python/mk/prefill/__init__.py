"""The packed prefill of the engine on a GPU (`packed`: prompts packed into one pass, flex attention and
grouped-GEMM experts) and its static passes replayed as CUDA graphs (`static`): of fresh prompts
(`fresh`) and of chunks after a cached prefix (`prefixed`)."""
