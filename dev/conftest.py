"""dev/'s tests choose the backend as tests/ does (the GPU where a driver works, else the
simulator), before any of them imports numba.cuda."""

from flashv41.stages.backend import select_backend

select_backend()
