# An alternate signal stack smaller than an AMX signal frame on the main thread: the kernel then refuses AMX tile data
# to the whole process (ENOSPC), as it would with any such thread alive when AMX is first requested.
import ctypes


class _Stack(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_buf = ctypes.create_string_buffer(8192)
ctypes.CDLL(None, use_errno=True).sigaltstack(ctypes.byref(_Stack(ctypes.cast(_buf, ctypes.c_void_p), 0, 8192)), None)
