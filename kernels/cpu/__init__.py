"""The native CPU kernels (C++ in native/, built by build.py on first CPU use) and the ISA switch
(isa.py).

Imports no torch: `isa.apply()` runs before torch first dispatches."""
