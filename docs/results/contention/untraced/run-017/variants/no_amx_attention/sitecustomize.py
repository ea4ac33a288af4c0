# vLLM's CPU attention picks its "amx" kernel when torch reports AMX tiles; report none, so it runs "vec".
import torch
torch.cpu._is_amx_tile_supported = lambda: False
