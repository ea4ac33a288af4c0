# Every torch.empty in the engine is filled (NaN for floating point): a computation that reads memory nobody wrote
# turns into NaN or changes.
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True
