"""Lightning plugins: precision (``plugins/precision``) and accelerators (``plugins/accelerators``)."""
