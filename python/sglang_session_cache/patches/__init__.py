"""Patch functions. Each is named by an entry in ``patch_table.PATCHES`` and
is called as ``fn(module)`` right after that SGLang module has been executed."""
