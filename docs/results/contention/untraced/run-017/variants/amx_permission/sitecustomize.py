# Ask the kernel for AMX tile data up front (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as oneDNN would have: with oneDNN
# capped below AMX nothing else asks, and vLLM's own AMX kernels would die of SIGILL.
import ctypes
ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)
