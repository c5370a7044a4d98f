"""A strict reader of zip archives from elsewhere, and the plain archive handed on to torch in their place.

Zip readers disagree on files crafted to be read two ways: Python's `zipfile`
finds the central directory through the end record's offset, corrected by
where it found the record; torch's reader (miniz) trusts the offset; neither
checks CRC-32 before handing bytes on, and both inflate whatever size a
member claims. `read_archive` accepts only an archive with one reading:

- one end record, ending exactly at the file's end (its comment included), with
  a zip64 end record and locator immediately before it when present (torch
  writes them), the two agreeing;
- one central directory, ending exactly where the end records start, holding
  exactly the entries it declares;
- every member's local header at the offset its central entry names, the first
  at byte 0, each member (header, data, data descriptor) followed at once by the
  next, the last by the central directory: no byte that nothing accounts for, no
  two members sharing bytes;
- names unique, valid UTF-8, relative, without ``..``, backslashes or NUL;
  local and central headers agreeing on name, method and flags; no encryption;
  stored or deflated data only;
- declared sizes bounded (each member and their sum) BEFORE anything is
  inflated, then the inflated size equal to the declared one and CRC-32 equal
  to the declared one, for every member.

`pack_archive` writes the checked members into a new stored archive in memory:
what torch reads is then exactly what was checked.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["ArchiveMember", "ArchiveError", "read_archive", "pack_archive"]

_END = b"PK\x05\x06"
_ZIP64_END = b"PK\x06\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_ESCAPE16, _ESCAPE32 = 0xFFFF, 0xFFFFFFFF
_STORED, _DEFLATED = 0, 8
_ENCRYPTED_FLAGS = 0x0001 | 0x0040 | 0x2000  # encrypted, strong encryption, masked local header
_DESCRIPTOR_FLAG = 0x0008
_UTF8_FLAG = 0x0800


class ArchiveError(ValueError):
    """An archive with more than one reading, or whose bytes disagree with what it declares."""


@dataclass(frozen=True)
class ArchiveMember:
    """One checked member: its name and its (uncompressed, CRC-verified) bytes."""

    name: str
    data: bytes


@dataclass(frozen=True)
class _Entry:
    name: str
    raw_name: bytes
    flags: int
    method: int
    crc: int
    compressed: int
    size: int
    offset: int
    zip64: bool


def _unpack(fmt: str, data: memoryview, at: int, what: str) -> tuple:
    end = at + struct.calcsize(fmt)
    if at < 0 or end > len(data):
        raise ArchiveError(f"{what} passes the end of the file (truncated, or an offset that points outside it)")
    return struct.unpack_from(fmt, data, at)


def _end_record(data: memoryview) -> tuple[int, int, int, int]:
    """``(entries, central size, central offset, where the end records start)``."""
    found = []
    for comment in range(min(len(data) - 22, _ESCAPE16) + 1):
        at = len(data) - 22 - comment
        if at >= 0 and data[at:at + 4] == _END and struct.unpack_from("<H", data, at + 20)[0] == comment:
            found.append(at)
    if not found:
        raise ArchiveError("no zip end record ends at the file's end (not a zip archive, or a truncated one)")
    if len(found) > 1:
        raise ArchiveError(f"{len(found)} zip end records could end the file (one hidden in the comment): "
                           "an archive with two readings")
    at = found[0]
    _, disk, start_disk, on_disk, entries, size, offset, _ = _unpack("<4sHHHHIIH", data, at, "the end record")
    start = at
    if at >= 20 and data[at - 20:at - 16] == _ZIP64_LOCATOR:
        _, locator_disk, zip64_at, disks = _unpack("<4sIQI", data, at - 20, "the zip64 locator")
        _, record_size, _, _, disk64, start64, on_disk64, entries64, size64, offset64 = _unpack(
            "<4sQHHIIQQQQ", data, zip64_at, "the zip64 end record")
        if data[zip64_at:zip64_at + 4] != _ZIP64_END or record_size != 44 or zip64_at + 56 != at - 20:
            raise ArchiveError("the zip64 end record is not where its locator says (bytes before the archive "
                               "that nothing accounts for, or a second archive in the file)")
        if locator_disk or disks != 1 or disk64 or start64 or on_disk64 != entries64:
            raise ArchiveError("the archive spans several disks")
        for short, wide, what in ((entries, entries64, "entry count"), (size, size64, "central directory size"),
                                  (offset, offset64, "central directory offset")):
            if short not in (_ESCAPE16, _ESCAPE32) and short != wide:
                raise ArchiveError(f"the end record and the zip64 end record disagree on the {what} "
                                   f"({short} and {wide}): an archive with two readings")
        entries, size, offset, start = entries64, size64, offset64, zip64_at
    elif _ESCAPE16 in (entries, on_disk) or _ESCAPE32 in (size, offset):
        raise ArchiveError("the end record asks for zip64 values, but no zip64 locator precedes it")
    if disk or start_disk or (on_disk != entries and on_disk != _ESCAPE16):
        raise ArchiveError("the archive spans several disks")
    if offset + size != start:
        raise ArchiveError(f"the central directory (offset {offset}, {size} bytes) does not end where the end "
                           f"records start (byte {start}): bytes that nothing accounts for, or a second archive")
    return entries, size, offset, start


def _zip64_extra(extra: bytes, size: int, compressed: int, offset: int, name: str) -> tuple[int, int, int]:
    """The sizes and offset, with the zip64 extra field's values where the 32-bit fields are escaped."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if at + 4 + length > len(extra):
            raise ArchiveError(f"member {name!r}: an extra field of {length} bytes passes the end of its header")
        if tag == 0x0001:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            fields = [size, compressed, offset]
            for position, value in enumerate(fields):
                if value == _ESCAPE32:
                    if not values:
                        raise ArchiveError(f"member {name!r}: its zip64 extra field lacks a value it escapes")
                    fields[position] = values.pop(0)
            return fields[0], fields[1], fields[2]
        at += 4 + length
    if _ESCAPE32 in (size, compressed, offset):
        raise ArchiveError(f"member {name!r} escapes a size or offset to zip64 but has no zip64 extra field")
    return size, compressed, offset


def _decode_name(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ArchiveError(f"member name {raw[:80]!r} is not valid UTF-8") from None
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or ".." in parts or "" in parts[:-1]:
        raise ArchiveError(f"member name {name[:200]!r} is not a plain relative path (absolute, '..', a "
                           "backslash, NUL or an empty part)")
    return name


def _central_entries(data: memoryview, entries: int, size: int, offset: int) -> list[_Entry]:
    result, names, at = [], set(), offset
    for _ in range(entries):
        (signature, _, _, flags, method, _, _, crc, compressed, usize, name_length, extra_length, comment_length,
         disk, _, _, local) = _unpack("<4sHHHHHHIIIHHHHHII", data, at, "a central directory entry")
        if signature != _CENTRAL:
            raise ArchiveError(f"the central directory holds fewer entries than the {entries} declared "
                               f"(no entry at byte {at})")
        raw = bytes(data[at + 46:at + 46 + name_length])
        extra = bytes(data[at + 46 + name_length:at + 46 + name_length + extra_length])
        name = _decode_name(raw)
        if name in names:
            raise ArchiveError(f"two members are named {name!r}: readers disagree on which one counts")
        names.add(name)
        if flags & _ENCRYPTED_FLAGS:
            raise ArchiveError(f"member {name!r} is encrypted")
        if method not in (_STORED, _DEFLATED):
            raise ArchiveError(f"member {name!r} uses compression method {method}; only stored (0) and deflated "
                               "(8) are read")
        if disk:
            raise ArchiveError(f"member {name!r} starts on another disk")
        zip64 = _ESCAPE32 in (usize, compressed, local)
        usize, compressed, local = _zip64_extra(extra, usize, compressed, local, name)
        result.append(_Entry(name, raw, flags, method, crc, compressed, usize, local, zip64))
        at += 46 + name_length + extra_length + comment_length
    if at != offset + size:
        raise ArchiveError(f"the central directory's {entries} entries take {at - offset} bytes, not the {size} "
                           "declared: bytes that nothing accounts for")
    return result


def _member_span(data: memoryview, entry: _Entry) -> tuple[int, int]:
    """``(data start, member end)`` of one member, its local header checked against its central entry."""
    what = f"member {entry.name!r}"
    (signature, _, flags, method, _, _, crc, compressed, usize, name_length,
     extra_length) = _unpack("<4sHHHHHIIIHH", data, entry.offset, f"{what}'s local header")
    if signature != _LOCAL:
        raise ArchiveError(f"{what}: no local header at byte {entry.offset}, where the central directory puts it")
    start = entry.offset + 30 + name_length + extra_length
    if bytes(data[entry.offset + 30:entry.offset + 30 + name_length]) != entry.raw_name:
        raise ArchiveError(f"{what}: its local header names another member: an archive with two readings")
    if flags != entry.flags or method != entry.method:
        raise ArchiveError(f"{what}: its local header and central entry disagree on flags or method")
    end = start + entry.compressed
    if end > len(data):
        raise ArchiveError(f"{what}: its data passes the end of the file (truncated)")
    if flags & _DESCRIPTOR_FLAG:
        if bytes(data[end:end + 4]) == _DESCRIPTOR:
            end += 4
        wide = entry.zip64 or entry.size > _ESCAPE32 or entry.compressed > _ESCAPE32
        crc, compressed, usize = _unpack("<IQQ" if wide else "<III", data, end, f"{what}'s data descriptor")
        end += 20 if wide else 12
    else:
        extra = bytes(data[entry.offset + 30 + name_length:start])
        usize, compressed, _ = _zip64_extra(extra, usize, compressed, 0, entry.name)
    if (crc, compressed, usize) != (entry.crc, entry.compressed, entry.size):
        raise ArchiveError(f"{what}: its local header (or data descriptor) and central entry disagree on the "
                           "CRC-32 or sizes: an archive with two readings")
    return start, end


def _inflate(entry: _Entry, raw: memoryview) -> bytes:
    if entry.method == _STORED:
        if entry.compressed != entry.size:
            raise ArchiveError(f"member {entry.name!r} is stored with {entry.compressed} bytes but declares "
                               f"{entry.size}")
        return bytes(raw)
    inflater = zlib.decompressobj(-15)
    try:
        out = inflater.decompress(raw, entry.size + 1)  # at most one byte more than declared
    except zlib.error as error:
        raise ArchiveError(f"member {entry.name!r}: its deflated data is corrupt ({error})") from None
    if len(out) != entry.size or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise ArchiveError(f"member {entry.name!r} declares {entry.size} bytes but its deflated data does not "
                           "inflate to exactly that: a corrupt or crafted member")
    return out


def read_archive(data: bytes, *, max_member_bytes: int, max_total_bytes: int, max_members: int = 100_000,
                 check_total: Optional[Callable[[int], None]] = None) -> tuple[ArchiveMember, ...]:
    """The members of the zip archive ``data``, every byte accounted for and checked (see the module docstring).

    Args:
        data: the whole file.
        max_member_bytes: the most bytes one member may declare once uncompressed.
        max_total_bytes: the most bytes all members together may declare once uncompressed.
        max_members: the most members the archive may hold.
        check_total: called with the declared uncompressed total before anything is inflated (a memory
            budget's check, which raises its own error).

    Returns:
        The members in the order they are stored.

    Raises:
        ArchiveError: naming the member (or record) and what is wrong; the bounds are checked on the declared
            sizes before anything is inflated.
    """
    view = memoryview(data)
    entries, size, offset, _ = _end_record(view)
    if entries > max_members:
        raise ArchiveError(f"the archive declares {entries} members, more than the {max_members} accepted")
    listed = _central_entries(view, entries, size, offset)
    total = 0
    for entry in listed:
        if entry.size > max_member_bytes:
            raise ArchiveError(f"member {entry.name!r} declares {entry.size} bytes uncompressed, more than the "
                               f"{max_member_bytes} accepted for one member")
        total += entry.size
    if total > max_total_bytes:
        raise ArchiveError(f"the members declare {total} bytes uncompressed together, more than the "
                           f"{max_total_bytes} accepted")
    if check_total is not None:
        check_total(total)
    position, members = 0, []
    for entry in sorted(listed, key=lambda item: item.offset):
        if entry.offset != position:
            problem = "overlaps the member before it" if entry.offset < position else \
                f"starts at byte {entry.offset}, after {entry.offset - position} bytes that nothing accounts for"
            raise ArchiveError(f"member {entry.name!r} {problem} (the previous member ends at byte {position})")
        start, position = _member_span(view, entry)
        content = _inflate(entry, view[start:start + entry.compressed])
        if zlib.crc32(content) != entry.crc:
            raise ArchiveError(f"member {entry.name!r} fails its CRC-32 check (declared {entry.crc:08x}, the "
                               f"bytes give {zlib.crc32(content):08x}): the file was altered or damaged")
        members.append(ArchiveMember(entry.name, content))
    if position != offset:
        raise ArchiveError(f"{offset - position} bytes between the last member (ending at byte {position}) and "
                           f"the central directory (byte {offset}) that nothing accounts for")
    return tuple(members)


def pack_archive(members: Sequence[ArchiveMember]) -> io.BytesIO:
    """A new stored (uncompressed) zip archive of ``members``, in memory, positioned at its start."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for member in members:
            archive.writestr(zipfile.ZipInfo(member.name, date_time=(1980, 1, 1, 0, 0, 0)), member.data)
    buffer.seek(0)
    return buffer
