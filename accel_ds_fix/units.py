"""Sizes in words for the messages: a byte count in the unit that shows it (0.0 GiB says nothing)."""

KIB, MIB, GIB = 2**10, 2**20, 2**30


def size_in_words(nbytes):
    """``nbytes`` as "12.3 KiB", "4.5 MiB" or "6.78 GiB": from 64 MiB on in GiB, with two decimals below 10 GiB and
    one above (a disk's free space); below that in MiB or KiB, so that a small size never reads as 0.0."""
    if nbytes < MIB:
        return f"{nbytes / KIB:.1f} KiB"
    if nbytes < 64 * MIB:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB" if nbytes < 10 * GIB else f"{nbytes / GIB:.1f} GiB"
