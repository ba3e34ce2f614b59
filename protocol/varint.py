"""Protobuf base-128 varints, for the hand-built frame fast paths (codec, NoLoCo exchange)."""


_SMALL = [bytes((i,)) for i in range(0x80)]


def encode_varint(n: int) -> bytes:
    if 0 <= n < 0x80:  # tags, small lengths, seq numbers: one byte, no bytearray
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(b, pos: int) -> tuple[int, int]:
    """(value, next position); (-1, pos) if no valid varint starts at ``pos``."""
    if pos < len(b) and b[pos] < 0x80:  # one-byte varints (tags, small values) skip the loop
        return b[pos], pos + 1
    result = shift = 0
    for i in range(pos, min(pos + 10, len(b))):
        byte = b[i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i + 1
        shift += 7
    return -1, pos  # not a valid varint: callers fall back to protobuf parsing
