"""Types of genie._C_keys, the server's command signatures (genie/csrc/server/keys_module.cpp)."""

def command_key(data: bytes, /) -> tuple[bytes, tuple[int, ...], tuple[float, ...]] | None:
    """A command's key (its bytes with every tensor tag's storage id and every float taken out, then the
    ids' aliasing pattern), the storage ids in order and the floats in order; None when the bytes cannot be
    keyed (the full path decides)."""
