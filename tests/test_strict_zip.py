"""sparsecore.torch.strict_zip: archives with one reading pass whole and byte-exact (Python's zipfile is the oracle
of a valid archive's contents); every archive crafted to read two ways, or whose bytes disagree with what it
declares, is refused naming the member or record, before anything is inflated past the bounds."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest

from tests.dense_oracle import make_rng

pytest.importorskip("torch")

from sparsecore.torch.strict_zip import ArchiveError, ArchiveMember, pack_archive, read_archive  # noqa: E402

LIMIT = 2**24


def _archive(members: dict, method: int = zipfile.ZIP_STORED, comment: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data,
                             compress_type=method)
        archive.comment = comment
    return buffer.getvalue()


@pytest.fixture(scope="module")
def contents() -> dict:
    rng = make_rng(3950)
    return {"root/a.bin": rng.bytes(3000), "root/b/c.json": b'{"x": 1}' * 50, "root/d": rng.bytes(17)}


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_an_archive_with_one_reading_passes_byte_exact_and_repacks(contents: dict, method: int) -> None:
    data = _archive(contents, method)
    members = read_archive(data, max_member_bytes=LIMIT, max_total_bytes=LIMIT)
    with zipfile.ZipFile(io.BytesIO(data)) as oracle:
        assert [(m.name, m.data) for m in members] == [(n, oracle.read(n)) for n in oracle.namelist()]
    again = read_archive(pack_archive(members).getvalue(), max_member_bytes=LIMIT, max_total_bytes=LIMIT)
    assert again == members
    assert read_archive(_archive({}), max_member_bytes=1, max_total_bytes=1) == ()  # an empty archive


def _local_data_offset(data: bytes, name: str) -> int:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo(name)
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_length + extra_length


def _case(contents: dict, case: str) -> tuple[bytes, str]:
    data = _archive(contents)
    if case == "flipped_byte":
        changed = bytearray(data)
        changed[_local_data_offset(data, "root/a.bin") + 100] ^= 1
        return bytes(changed), "member 'root/a.bin' fails its CRC-32 check"
    if case == "prefix":
        return b"MZ" + b"\0" * 60 + data, "bytes that nothing accounts for"
    if case == "appended_archive":
        return _archive({"evil/x": b"1"}) + data, "nothing accounts for"
    if case == "gap_between_members":
        first = _archive({"root/a.bin": contents["root/a.bin"]})
        second = _archive({"root/d": contents["root/d"]})
        # stitch by hand: member one, 5 junk bytes, member two, then a central directory naming both
        one = zipfile.ZipFile(io.BytesIO(first)).infolist()[0]
        two = zipfile.ZipFile(io.BytesIO(second)).infolist()[0]
        end_one = _local_data_offset(first, "root/a.bin") + one.compress_size
        end_two = _local_data_offset(second, "root/d") + two.compress_size
        body = first[:end_one] + b"JUNK!" + second[:end_two]
        central_one = first[end_one:first.index(b"PK\x05\x06")]
        central_two = bytearray(second[end_two:second.index(b"PK\x05\x06")])
        struct.pack_into("<I", central_two, 42, end_one + 5)
        central = central_one + bytes(central_two)
        end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 2, 2, len(central), len(body), 0)
        return body + central + end, "member 'root/d' starts at byte .*after 5 bytes that nothing accounts for"
    if case == "overlapping_members":
        changed = bytearray(data)
        central = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02") + 4)  # the second entry points at the first
        struct.pack_into("<I", changed, central + 42, 0)
        return bytes(changed), "(overlaps the member before it|local header names another member)"
    if case == "duplicate_names":
        return _archive({"root/a": b"1", "root/b": b"2"}).replace(b"root/b", b"root/a"), "two members are named"
    if case == "fake_end_in_comment":
        fake = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0, 0, 0, 0, 0)
        return _archive(contents, comment=b"x" + fake), "2 zip end records could end the file"
    if case == "size_lie":
        packed = bytearray(_archive(contents, zipfile.ZIP_DEFLATED))
        for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # declare 10 bytes fewer, both headers
            position = packed.index(signature)
            size = struct.unpack_from("<I", packed, position + at)[0]
            struct.pack_into("<I", packed, position + at, size - 10)
        return bytes(packed), "declares 2990 bytes but its deflated data does not inflate to exactly that"
    if case == "over_member_bound":
        return data, "member 'root/a.bin' declares 3000 bytes uncompressed, more than the 2000 accepted"
    if case == "encrypted":
        changed = bytearray(data)
        for signature, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            position = changed.index(signature)
            struct.pack_into("<H", changed, position + at, 1)
        return bytes(changed), "member 'root/a.bin' is encrypted"
    if case == "path_outside":
        return _archive({"root/../etc/passwd": b"x"}), "not a plain relative path"
    if case == "truncated":
        return data[:len(data) // 2], "no zip end record"
    raise AssertionError(case)


CASES = ("flipped_byte", "prefix", "appended_archive", "gap_between_members", "overlapping_members",
         "duplicate_names", "fake_end_in_comment", "size_lie", "over_member_bound", "encrypted", "path_outside",
         "truncated")


@pytest.mark.parametrize("case", CASES)
def test_an_archive_that_reads_two_ways_or_lies_is_refused_naming_what(contents: dict, case: str) -> None:
    data, message = _case(contents, case)
    bound = 2000 if case == "over_member_bound" else LIMIT
    with pytest.raises(ArchiveError, match=message):
        read_archive(data, max_member_bytes=bound, max_total_bytes=LIMIT)


def test_a_deflate_bomb_is_refused_on_its_declared_size_before_inflating() -> None:
    seen = []
    bomb = _archive({"root/zeros": bytes(2**22)}, zipfile.ZIP_DEFLATED)  # 4 MiB of zeros, about 4 KiB on disk
    assert len(bomb) < 2**13
    with pytest.raises(ArchiveError, match="the members declare 4194304 bytes uncompressed together, more than"):
        read_archive(bomb, max_member_bytes=2**23, max_total_bytes=2**20)
    with pytest.raises(MemoryError, match="budget"):
        def check(total: int) -> None:
            seen.append(total)
            raise MemoryError("over the budget")
        read_archive(bomb, max_member_bytes=2**23, max_total_bytes=2**23, check_total=check)
    assert seen == [2**22]
    assert read_archive(bomb, max_member_bytes=2**23, max_total_bytes=2**23)[0] == ArchiveMember("root/zeros",
                                                                                               bytes(2**22))



def test_an_extra_field_longer_than_its_header_is_refused() -> None:
    from sparsecore.torch.strict_zip import _zip64_extra

    with pytest.raises(ArchiveError, match="member 'n': an extra field of 16 bytes passes the end of its header"):
        _zip64_extra(struct.pack("<HH", 1, 16) + bytes(8), 0xFFFFFFFF, 5, 0, "n")
    assert _zip64_extra(struct.pack("<HHQ", 1, 8, 123), 0xFFFFFFFF, 5, 0, "n") == (123, 5, 0)
