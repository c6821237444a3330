"""Framework backends of lora_core: ``backends.torch`` and ``backends.jittor``.

Each holds modules of the same names (``lora``, ``model``, ``optim``, ``train``,
``generate``) exporting the same public names with the same signatures; the contract
is documented in ``lora_core`` and in the torch backend's docstrings.
"""
