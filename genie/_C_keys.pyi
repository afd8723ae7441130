"""Types of genie._C_keys, the server's command signatures (genie/csrc/server_keys.cpp)."""

def command_key(data: bytes, /) -> tuple[bytes, tuple[int, ...]] | None:
    """A command's key (its bytes with every tensor tag's storage id taken out, then the ids' aliasing
    pattern) and the storage ids in order; None when the bytes cannot be keyed (the full path decides)."""
