"""Layer 10: the storage backend (storage types, meta files, volumes, replicas).

Everything runs on real files under a temporary directory, no mocks. The meta file is always
checked independently of ``backends/meta.py``, with ``struct`` and ``crc32c`` directly, so a
bug shared by the writer and the reader cannot hide.

The volume tests take a ``volume`` fixture and use only the public interface: they are the
contract any volume implementation (a fault-injecting one, say) must pass.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tierfs.backends import crc_combine, meta
from tierfs.backends import replica as replica_module
from tierfs.backends.replica import DIRECT_WRITE_BYTES, Replica
from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import IDENTITY_FILE, ReplicaInfo, Volume
from tierfs.fs.errors import ChecksumError, FsError, VolumeError
from tests.conftest import evict, fill_disk, small_disk

FS_UUID = "6f1c9a57-0000-4000-8000-000000000001"
BLOCK = 1 << 30  # first block id after HDFS's reserved range
GS = 1001  # first generation stamp after HDFS's reserved range


# ---------------------------------------------------------------------- helpers


def independent_meta(path: Path) -> tuple[tuple[int, int, int], list[int]]:
    """Header fields and CRCs of a meta file, parsed without tierfs code."""
    raw = path.read_bytes()
    assert len(raw) >= 7 and (len(raw) - 7) % 4 == 0, f"meta file size {len(raw)}"
    header = struct.unpack(">hbi", raw[:7])
    crcs = [struct.unpack(">I", raw[i : i + 4])[0] for i in range(7, len(raw), 4)]
    return header, crcs


def expected_crcs(data: bytes, bpc: int) -> list[int]:
    return [crc32c.crc32c(data[i : i + bpc]) for i in range(0, len(data), bpc)]


def assert_replica_files(volume: Volume, block_id: int, gs: int, bpc: int, model: bytes) -> None:
    """The data file holds ``model`` and the meta file holds exactly its chunk CRCs."""
    assert volume.data_path(block_id).read_bytes() == model
    header, crcs = independent_meta(volume.meta_path(block_id, gs))
    assert header == (1, 2, bpc)
    assert crcs == expected_crcs(model, bpc)


def files_size(volume: Volume) -> int:
    """Bytes in every blk_ file under the volume, counted from the files themselves."""
    total = 0
    for root, _, names in os.walk(volume.path / "current"):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names if n.startswith("blk_"))
    return total


def make_volume(path, storage_type=StorageType.SSD, capacity=None, volume_id=1) -> Volume:
    return Volume.format(path, fs_uuid=FS_UUID, volume_id=volume_id, storage_type=storage_type, capacity=capacity)


def reopen(volume: Volume, **changes) -> Volume:
    args = dict(
        fs_uuid=volume.fs_uuid,
        volume_uuid=volume.uuid,
        volume_id=volume.id,
        storage_type=volume.storage_type,
        capacity=volume.capacity,
    )
    args.update(changes)
    return Volume.open(volume.path, **args)


@pytest.fixture
def volume(tmp_path) -> Volume:
    return make_volume(tmp_path / "ssd0")


@pytest.fixture
def replica(volume):
    r = volume.create_replica(BLOCK, GS, 16)
    yield r
    r.close()


# ---------------------------------------------------------------------- storage types


def test_storage_types_are_ordered_fastest_first():
    assert [t.name for t in sorted(StorageType)] == ["RAM_DISK", "NVDIMM", "SSD", "DISK", "ARCHIVE", "PROVIDED"]
    assert [int(t) for t in StorageType] == list(range(6))


def test_storage_type_properties():
    assert [t for t in StorageType if t.transient] == [StorageType.RAM_DISK]
    assert [t for t in StorageType if t.is_ram] == [StorageType.RAM_DISK, StorageType.NVDIMM]
    assert [t for t in StorageType if not t.movable] == [StorageType.RAM_DISK]


@pytest.mark.parametrize("text", ["ssd", "SSD", "Ssd", " ssd\n"])
def test_storage_type_parse_ignores_case(text):
    assert StorageType.parse(text) is StorageType.SSD


def test_storage_type_parse_names_the_choices():
    with pytest.raises(ValueError) as e:
        StorageType.parse("flash")
    assert str(e.value) == (
        "unknown storage type 'flash' (expected one of RAM_DISK, NVDIMM, SSD, DISK, ARCHIVE, PROVIDED)"
    )


def test_storage_type_prints_its_name():
    assert str(StorageType.ARCHIVE) == "ARCHIVE"
    assert f"{StorageType.DISK}" == "DISK"


# ---------------------------------------------------------------------- meta format


def test_header_bytes_are_hdfs_exact():
    assert meta.header_bytes(512) == b"\x00\x01\x02\x00\x00\x02\x00"
    assert meta.header_bytes(4096) == b"\x00\x01\x02\x00\x00\x10\x00"
    assert (meta.VERSION, meta.CRC32C, meta.HEADER_SIZE) == (1, 2, 7)


def test_parse_header_round_trips():
    assert meta.parse_header(meta.header_bytes(65536)) == (1, 2, 65536)
    assert meta.parse_header(meta.header_bytes(7) + b"\x00\x00\x00\x01") == (1, 2, 7)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00\x01\x02\x00\x00\x10",  # short
        b"\x00\x02\x02\x00\x00\x10\x00",  # version 2
        b"\x00\x01\x01\x00\x00\x10\x00",  # CRC32, not CRC32C
        b"\x00\x01\x00\x00\x00\x10\x00",  # NULL checksum
        b"\x00\x01\x02\x00\x00\x00\x00",  # zero bytes per checksum
        b"\x00\x01\x02\xff\xff\xff\xff",  # negative bytes per checksum
    ],
)
def test_parse_header_refuses_malformed(raw):
    with pytest.raises(ChecksumError) as e:
        meta.parse_header(raw)
    assert e.value.errno == errno.EIO


def test_header_bytes_refuses_bad_chunk_size():
    for bpc in (0, -1, 2**31):
        with pytest.raises(ValueError):
            meta.header_bytes(bpc)


def test_meta_size():
    assert meta.meta_size(0, 512) == 7
    assert meta.meta_size(1, 512) == 11
    assert meta.meta_size(512, 512) == 11
    assert meta.meta_size(513, 512) == 15
    assert meta.meta_size(128 << 20, 512) == 1_048_583  # the reference's example


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 100])
def test_chunk_crcs_match_independent_computation(length):
    data = os.urandom(length)
    expect = b"".join(struct.pack(">I", c) for c in expected_crcs(data, 16))
    assert meta.chunk_crcs(data, 16) == expect
    assert meta.chunk_crcs(memoryview(data), 16) == expect
    assert meta.chunk_crcs(bytearray(data), 16) == expect


def test_chunk_crc_list_continues_a_partial_chunk():
    data = os.urandom(50)
    head = crc32c.crc32c(data[:5])
    assert meta.chunk_crc_list(data[5:], 16, skip=5, value=head) == expected_crcs(data, 16)


def _stored_crcs(data: bytes, bpc: int) -> bytes:
    return b"".join(struct.pack(">I", c) for c in expected_crcs(data, bpc))


def _flip_bit(raw: bytes, bit: int) -> bytes:
    out = bytearray(raw)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(bpc=st.sampled_from([16, 512]), chunks=st.integers(0, crc_combine.GROUP + 40),
       tail=st.integers(0, 15), damage=st.sampled_from(["none", "data", "crcs", "short", "long"]),
       where=st.floats(0, 1, exclude_max=True), seed=st.binary(min_size=8, max_size=8))
def test_chunks_match_is_chunk_by_chunk_comparison(bpc, chunks, tail, damage, where, seed):
    """Checking a run through one combined CRC says exactly what comparing each chunk's CRC
    says, on runs below, at and above the size where combining starts and past a table's
    GROUP, with one bit flipped anywhere in the data or in the stored CRCs."""
    data = original = (seed * (bpc // 8 * chunks + 2))[: bpc * chunks + tail]
    stored = right = _stored_crcs(data, bpc)
    if damage == "data" and data:
        data = _flip_bit(data, int(where * len(data) * 8))
    elif damage == "crcs" and stored:
        stored = _flip_bit(stored, int(where * len(stored) * 8))
    elif damage == "short":
        stored = stored[:-4]
    elif damage == "long":
        stored += b"\0\0\0\0"
    expect = meta.chunk_crcs(data, bpc) == stored
    assert crc_combine.chunks_match(data, stored, bpc) is expect
    assert crc_combine.chunks_match(memoryview(data), stored, bpc) is expect
    assert expect is ((data, stored) == (original, right))


def test_chunks_match_checks_every_group_and_the_partial_tail():
    """Damage in any chunk of a run several tables long, the partial last chunk included, in
    its data or in its stored CRC, is caught."""
    bpc = 16
    count = 3 * crc_combine.GROUP + 5
    data = os.urandom(count * bpc + 7)
    stored = _stored_crcs(data, bpc)
    for chunk in [*range(0, count + 1, 37), crc_combine.GROUP, 2 * crc_combine.GROUP - 1,
                  count - 1, count]:
        bit = (chunk * bpc + 3) * 8
        assert not crc_combine.chunks_match(_flip_bit(data, bit), stored, bpc), chunk
        assert not crc_combine.chunks_match(data, _flip_bit(stored, chunk * 32 + 5), bpc), chunk
    assert crc_combine.chunks_match(data, stored, bpc)


def test_chunks_match_catches_swapped_chunks_and_swapped_crcs():
    data = os.urandom(64 * 512)
    stored = _stored_crcs(data, 512)
    swapped = data[512:1024] + data[:512] + data[1024:]
    assert not crc_combine.chunks_match(swapped, stored, 512)
    assert not crc_combine.chunks_match(data, stored[4:8] + stored[:4] + stored[8:], 512)
    assert crc_combine.chunks_match(swapped, _stored_crcs(swapped, 512), 512)


def test_chunks_match_of_zeros_needs_the_crcs_of_zeros():
    """A meta file left zero-filled (a crash in the middle of a write) over zero data must
    not verify: the CRC32C of zeros is not zero."""
    zeros = bytes(300 * 512)
    assert not crc_combine.chunks_match(zeros, bytes(300 * 4), 512)
    assert crc_combine.chunks_match(zeros, _stored_crcs(zeros, 512), 512)


def test_run_matches_refuses_a_run_that_is_not_whole_chunks():
    with pytest.raises(ValueError):
        crc_combine.run_matches(bytes(100), bytes(4), 64)


# ---------------------------------------------------------------------- format and open


def test_format_writes_identity_and_layout(tmp_path):
    v = make_volume(tmp_path / "a" / "ssd0", StorageType.SSD, volume_id=7)
    identity = json.loads((tmp_path / "a" / "ssd0" / IDENTITY_FILE).read_text())
    assert identity == {
        "layout_version": 1,
        "fs_uuid": FS_UUID,
        "volume_uuid": v.uuid,
        "volume_id": 7,
        "storage_type": "SSD",
    }
    assert (v.path / "current" / "finalized").is_dir()
    assert v.tmp_dir == v.path / "tmp" and v.tmp_dir.is_dir()
    assert sorted(os.listdir(v.path)) == ["VERSION", "current", "tmp"]
    assert (v.id, v.storage_type, v.capacity) == (7, StorageType.SSD, None)
    assert v.used_bytes() == 0


def test_format_uses_an_existing_empty_directory(tmp_path):
    make_volume(tmp_path)
    assert (tmp_path / IDENTITY_FILE).is_file()


def test_format_refuses_a_volume(volume):
    with pytest.raises(VolumeError) as e:
        make_volume(volume.path)
    assert str(e.value) == f"volume directory {volume.path} is not empty"


def test_format_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(VolumeError) as e:
        make_volume(tmp_path)
    assert str(e.value) == f"volume directory {tmp_path} is not empty"
    assert sorted(os.listdir(tmp_path)) == ["precious.txt"]


def test_open_finds_what_format_made(volume):
    v = reopen(volume, capacity=1 << 20)
    assert (v.uuid, v.id, v.storage_type, v.capacity, v.path) == (volume.uuid, 1, StorageType.SSD, 1 << 20, volume.path)


def test_open_missing_volume(tmp_path):
    with pytest.raises(VolumeError) as e:
        Volume.open(
            tmp_path / "gone", fs_uuid=FS_UUID, volume_uuid="u", volume_id=1, storage_type=StorageType.SSD, capacity=None
        )
    assert str(e.value) == f"volume {tmp_path / 'gone'} (SSD) is missing"


def test_open_directory_without_identity(tmp_path):
    with pytest.raises(VolumeError) as e:
        Volume.open(
            tmp_path, fs_uuid=FS_UUID, volume_uuid="u", volume_id=1, storage_type=StorageType.SSD, capacity=None
        )
    assert str(e.value) == f"{tmp_path} is not a tierfs volume (no VERSION file)"


def test_open_foreign_filesystem(volume):
    with pytest.raises(VolumeError) as e:
        reopen(volume, fs_uuid="other-fs")
    assert str(e.value) == f"{volume.path} belongs to another tierfs filesystem (fs uuid {FS_UUID}, expected other-fs)"


def test_open_swapped_volume(volume):
    with pytest.raises(VolumeError) as e:
        reopen(volume, volume_uuid="other-volume")
    assert str(e.value) == f"{volume.path} is volume {volume.uuid}, expected other-volume"


def test_open_wrong_volume_id(volume):
    with pytest.raises(VolumeError) as e:
        reopen(volume, volume_id=2)
    assert str(e.value) == f"{volume.path} is volume id 1, expected 2"


def test_open_wrong_storage_type(volume):
    with pytest.raises(VolumeError) as e:
        reopen(volume, storage_type=StorageType.ARCHIVE)
    assert str(e.value) == f"{volume.path} is a SSD volume, expected ARCHIVE"


def test_open_malformed_identity(volume):
    (volume.path / IDENTITY_FILE).write_text("{not json")
    with pytest.raises(VolumeError) as e:
        reopen(volume)
    assert str(e.value).startswith(f"{volume.path} has a malformed VERSION file (")


def test_open_future_layout(volume):
    identity = json.loads((volume.path / IDENTITY_FILE).read_text())
    identity["layout_version"] = 2
    (volume.path / IDENTITY_FILE).write_text(json.dumps(identity))
    with pytest.raises(VolumeError) as e:
        reopen(volume)
    assert str(e.value) == f"{volume.path} has layout version 2, this tierfs supports 1"


def test_open_damaged_layout(volume):
    shutil.rmtree(volume.path / "current")
    with pytest.raises(VolumeError) as e:
        reopen(volume)
    assert str(e.value) == f"{volume.path} is damaged: {volume.path}/current/finalized is missing"


# ---------------------------------------------------------------------- layout


@pytest.mark.parametrize(
    "block_id, a, b",
    [(0, 0, 0), (0x12345678, 0x14, 0x16), (BLOCK + 0x1F1F00, 0x1F, 0x1F), (BLOCK + 0x200000, 0, 0), (-1, 31, 31)],
)
def test_layout_paths(volume, block_id, a, b):
    leaf = volume.path / "current" / "finalized" / f"subdir{a}" / f"subdir{b}"
    assert volume.data_path(block_id) == leaf / f"blk_{block_id}"
    assert volume.meta_path(block_id, 1005) == leaf / f"blk_{block_id}_1005.meta"


# ---------------------------------------------------------------------- create, write, read


def test_create_makes_empty_durable_replica(volume):
    with volume.create_replica(BLOCK, GS, 512) as r:
        assert (r.volume, r.block_id, r.gs, r.bytes_per_checksum, r.length) == (volume, BLOCK, GS, 512, 0)
        assert volume.data_path(BLOCK).read_bytes() == b""
        assert volume.meta_path(BLOCK, GS).read_bytes() == b"\x00\x01\x02\x00\x00\x02\x00"
        assert volume.used_bytes() == 7
        assert r.read(0, 100) == b""


def test_create_refuses_an_existing_replica(volume):
    volume.create_replica(BLOCK, GS, 512).close()
    with pytest.raises(VolumeError) as e:
        volume.create_replica(BLOCK, GS + 1, 512)
    assert e.value.errno == errno.EEXIST
    assert volume.meta_gss(BLOCK) == [GS]
    assert volume.used_bytes() == 7


@pytest.mark.parametrize("err, expected", [(errno.EMFILE, errno.EMFILE),
                                            (errno.ENFILE, errno.ENFILE),
                                            (errno.EACCES, errno.EIO)])
def test_out_of_descriptors_is_not_a_volume_error(volume, monkeypatch, err, expected):
    """Opening or syncing a replica when the process has no descriptor left says so
    (EMFILE/ENFILE), so that callers do not count it against the replica or the volume;
    any other failure is EIO."""
    volume.create_replica(BLOCK, GS, 512).close()
    real_open = os.open

    def failing_open(path, *args, **kwargs):
        if "blk_" in os.fspath(path):
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(VolumeError) as opening:
        volume.open_replica(BLOCK, GS, writable=False)
    with pytest.raises(VolumeError) as syncing:
        volume.sync_replica(BLOCK, GS)
    assert (opening.value.errno, syncing.value.errno) == (expected, expected)


def test_write_read_round_trip(volume):
    data = os.urandom(10_000)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data[:100])
        r.write(100, memoryview(data)[100:5000])
        r.write(5000, bytearray(data[5000:]))
        assert r.length == 10_000
        assert r.read(0, 20_000) == data
        assert r.read(511, 2) == data[511:513]
        assert r.read(9_999, 10) == data[-1:]
        assert r.read(10_000, 10) == b""
        assert r.read(50_000, 10) == b""
        assert r.read(5, 0) == b""
    with volume.open_replica(BLOCK, GS, writable=False) as r:
        assert r.length == 10_000
        assert r.read(0, 10_000) == data
    assert_replica_files(volume, BLOCK, GS, 512, data)
    assert volume.used_bytes() == 10_000 + meta.meta_size(10_000, 512) == files_size(volume)


def test_write_past_the_end_fills_zeros(replica, volume):
    replica.write(5, b"abc")
    replica.write(100, b"xyz")
    model = b"\0" * 5 + b"abc" + b"\0" * 92 + b"xyz"
    assert replica.read(0, 1000) == model
    assert_replica_files(volume, BLOCK, GS, 16, model)


def test_appends_that_fill_a_chunk_exactly(replica, volume):
    """The cached CRC of a partial chunk must not leak into the next chunk."""
    model = b""
    for piece in (b"a", b"bb" * 5, b"c" * 5, b"d", b"e" * 15, b"f" * 16, b"g" * 3, b"h" * 13):
        replica.write(len(model), piece)
        model += piece
        assert_replica_files(volume, BLOCK, GS, 16, model)
    replica.write(10, b"X" * 22)  # ends exactly at a chunk boundary inside the data
    model = model[:10] + b"X" * 22 + model[32:]
    replica.write(len(model), b"tail")
    assert_replica_files(volume, BLOCK, GS, 16, model + b"tail")
    assert volume.used_bytes() == files_size(volume)


def test_truncate_cuts_and_extends(replica, volume):
    data = os.urandom(100)
    replica.write(0, data)
    replica.truncate(37)
    assert replica.read(0, 1000) == data[:37]
    assert_replica_files(volume, BLOCK, GS, 16, data[:37])
    replica.truncate(70)
    model = data[:37] + bytes(33)
    assert replica.read(0, 1000) == model
    assert_replica_files(volume, BLOCK, GS, 16, model)
    replica.truncate(0)
    assert_replica_files(volume, BLOCK, GS, 16, b"")
    assert volume.used_bytes() == 7 == files_size(volume)


def test_readers_see_the_writer(replica, volume):
    with volume.open_replica(BLOCK, GS, writable=False) as reader:
        replica.write(0, b"hello")
        assert reader.length == 5
        assert reader.read(0, 100) == b"hello"
        replica.write(5, b" world")
        assert reader.read(0, 100) == b"hello world"


def test_two_writers_keep_crcs_exact(replica, volume):
    """A second writable handle on the same replica must not use stale cached CRCs."""
    with volume.open_replica(BLOCK, GS, writable=True) as other:
        replica.write(0, b"abc")
        other.write(3, b"def")
        replica.write(6, b"ghi")
        other.truncate(4)
        replica.write(4, b"XY")
    assert_replica_files(volume, BLOCK, GS, 16, b"abcdXY")
    assert volume.used_bytes() == files_size(volume)


def test_reader_thread_never_sees_half_written_chunks(replica, volume):
    """Writes and reads from different threads: a read sees data and CRCs that agree."""
    pieces = [bytes([i % 251]) * (1 + i % 37) for i in range(3000)]
    expected = b"".join(pieces)
    failures = []

    def append_all():
        pos = 0
        for piece in pieces:
            replica.write(pos, piece)
            pos += len(piece)

    writer = threading.Thread(target=append_all)
    with volume.open_replica(BLOCK, GS, writable=False) as reader:
        writer.start()
        while writer.is_alive():
            try:
                got = reader.read(0, len(expected))
            except ChecksumError as e:
                failures.append(e)
                break
            if got != expected[: len(got)]:
                failures.append(len(got))
                break
        writer.join()
    assert failures == []
    assert replica.read(0, len(expected)) == expected


def test_open_missing_replica(volume):
    with pytest.raises(VolumeError) as e:
        volume.open_replica(BLOCK, GS, writable=False)
    assert e.value.errno == errno.EIO
    assert str(e.value) == f"replica blk_{BLOCK}_{GS} is missing on volume {volume.path} (no data file blk_{BLOCK})"
    volume.create_replica(BLOCK, GS, 16).close()
    with pytest.raises(VolumeError) as e:
        volume.open_replica(BLOCK, GS + 1, writable=True)
    assert str(e.value).endswith(f"(no meta file blk_{BLOCK}_{GS + 1}.meta)")


def test_open_replica_with_damaged_header(volume):
    volume.create_replica(BLOCK, GS, 16).close()
    volume.meta_path(BLOCK, GS).write_bytes(b"\x00\x01\x01\x00\x00\x00\x10")
    with pytest.raises(ChecksumError) as e:
        volume.open_replica(BLOCK, GS, writable=False)
    assert "unsupported checksum type 1" in str(e.value)


def test_misuse_is_loud(volume):
    volume.create_replica(BLOCK, GS, 16).close()
    reader = volume.open_replica(BLOCK, GS, writable=False)
    with pytest.raises(ValueError, match="read-only"):
        reader.write(0, b"x")
    with pytest.raises(ValueError, match="read-only"):
        reader.truncate(0)
    reader.close()
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.read(0, 1)


def test_enospc_from_the_os_is_enospc(volume):
    """/dev/full answers every write with ENOSPC: a real device, not a mock."""
    meta_fd = os.open(tempfile.mktemp(dir=volume.tmp_dir), os.O_RDWR | os.O_CREAT)
    os.pwrite(meta_fd, meta.header_bytes(16), 0)
    r = Replica(volume, BLOCK, GS, 16, os.open("/dev/full", os.O_RDWR), meta_fd, writable=True)
    with pytest.raises(FsError) as e:
        r.write(0, b"x" * 10)
    assert e.value.errno == errno.ENOSPC
    assert str(volume.path) in str(e.value)
    r.close()


@pytest.mark.parametrize("bpc", [512, 4096, 65536])
def test_a_write_cut_short_by_a_full_disk_leaves_every_chunk_verifiable(tmp_path, bpc):
    """A write into a hole of a sparse replica (left by a write past its end or a truncate
    up) needs new pages; on a full disk ``pwrite`` stores part of the data and then fails
    with ENOSPC. The CRCs must then describe what the data file holds: before, they still
    described the zeros, and every later read of those chunks failed with a checksum
    error (fsstress on a full disk found it)."""
    with small_disk(tmp_path, "4m") as disk:
        volume = make_volume(disk / "v")
        r = volume.create_replica(BLOCK, GS, bpc)
        try:
            r.write(0, b"a" * 1000)
            r.write((2 << 20) - 10, b"z" * 10)   # a hole from 1000 to 2 MiB - 10
            filler = fill_disk(disk, room=64 * 1024)
            payload = os.urandom(1 << 20)
            with pytest.raises(FsError) as caught:
                r.write(3000, payload)
            assert caught.value.errno == errno.ENOSPC
            content = r.read(0, 2 << 20)        # verified: no ChecksumError
            assert len(content) == 2 << 20
            assert content[:1000] == b"a" * 1000 and content[-10:] == b"z" * 10
            new = content[3000:3000 + len(payload)]
            stored = next(i for i in range(len(new) + 1)
                          if i == len(new) or new[i] != payload[i])
            assert stored > 0 and not any(new[stored:])  # what was stored, then zeros

            # An append cut short, and a write past the end whose CRCs find no room: the
            # length stays, and nothing past it is left in either file.
            for at in (2 << 20, 3 << 20):
                os.truncate(filler, filler.stat().st_size - 64 * 1024)
                with pytest.raises(FsError) as caught:
                    r.write(at, payload)
                assert caught.value.errno == errno.ENOSPC
                assert volume.data_path(BLOCK).stat().st_size == 2 << 20
                assert volume.meta_path(BLOCK, GS).stat().st_size == meta.meta_size(2 << 20, bpc)
                assert r.read(0, 3 << 20) == content
        finally:
            r.close()
        reader = volume.open_replica(BLOCK, GS, writable=False)
        try:
            assert reader.read(0, 3 << 20) == content
        finally:
            reader.close()


@pytest.mark.parametrize("bpc", [512, 4096])
def test_after_a_failed_write_the_next_append_and_old_damage_are_right(tmp_path, bpc):
    """A growth taken back after its write failed leaves no cached CRC of the zeros for
    the next small append to continue from; and bytes before a failed append that were
    already damaged are still reported, not given a fresh CRC (their chunk is where the
    write stopped, but they are not the write's)."""
    with small_disk(tmp_path, "4m") as disk:
        volume = make_volume(disk / "v")
        r = volume.create_replica(BLOCK, GS, bpc)
        try:
            r.write(0, b"a" * 1024)
            filler = fill_disk(disk, room=64 * 1024)
            with pytest.raises(FsError):
                r.write((3 << 20) + 100, os.urandom(1 << 20))
            r.write(1024, b"b" * 10)
            assert r.read(0, 2048) == b"a" * 1024 + b"b" * 10
        finally:
            r.close()
        filler.unlink()

        volume.delete_replica(BLOCK, GS)
        r = volume.create_replica(BLOCK, GS, bpc)
        try:
            r.write(0, b"a" * 100)
            with open(volume.data_path(BLOCK), "r+b") as f:
                f.seek(10)
                f.write(b"X")
            with pytest.raises(ChecksumError):
                r.read(0, 100)
            fill_disk(disk, room=64 * 1024)
            with pytest.raises(FsError):
                r.write(100, os.urandom(1 << 20))
            with pytest.raises(ChecksumError):
                r.read(0, 100)
        finally:
            r.close()


# ---------------------------------------------------------------------- random writes against a model


class ReplicaMachine(RuleBasedStateMachine):
    """Random writes, truncates, reopens and GS bumps against a bytearray."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.volume = make_volume(Path(self.tmp.name) / "v")
        self.model = bytearray()
        self.replica = None

    @initialize(bpc=st.sampled_from([1, 2, 3, 16, 64, 512]))
    def create(self, bpc):
        # whole-page writes below go direct (O_DIRECT), mixed with the small ones
        replica_module.DIRECT_WRITE_BYTES = 4096
        self.bpc = bpc
        self.gs = GS
        self.replica = self.volume.create_replica(BLOCK, GS, bpc)

    @rule(offset=st.integers(0, 700), data=st.binary(min_size=0, max_size=300))
    def write(self, offset, data):
        self.replica.write(offset, data)
        if data:
            if offset > len(self.model):
                self.model.extend(bytes(offset - len(self.model)))
            self.model[offset : offset + len(data)] = data

    @rule(offset=st.integers(0, 700), size=st.integers(1, 300))
    def write_same_size_pattern(self, offset, size):
        """Writes whose bytes differ from the old ones, so a missed CRC update shows."""
        self.write(offset, bytes((offset + i) % 251 for i in range(size)))

    @rule(data=st.one_of(st.binary(min_size=1, max_size=4), st.binary(min_size=1, max_size=70)))
    def append(self, data):
        """Appends exercise the cached CRC of the partial last chunk (random offsets rarely do)."""
        self.write(len(self.model), data)

    @rule(extra=st.sampled_from([0, 0, 1, -1]))
    def append_to_chunk_boundary(self, extra):
        """Appends ending exactly at, or one byte around, the end of the current chunk."""
        size = self.bpc - len(self.model) % self.bpc + extra
        if size > 0:
            self.write(len(self.model), bytes((len(self.model) + i) % 253 for i in range(size)))

    @rule(back=st.integers(0, 70), data=st.binary(min_size=1, max_size=140))
    def write_near_end(self, back, data):
        self.write(max(0, len(self.model) - back), data)

    @rule(page=st.integers(0, 2), pages=st.integers(1, 2), tail=st.sampled_from([0, 0, 1, 300]),
          seed=st.integers(0, 255))
    def write_pages(self, page, pages, tail, seed):
        """Page-aligned writes of whole pages (and a tail): the direct path, over data the
        small writes left in the page cache."""
        self.write(page * 4096, bytes((seed + i) % 249 for i in range(pages * 4096 + tail)))

    @rule(length=st.one_of(st.integers(0, 800), st.integers(0, 3 * 4096 + 300)))
    def truncate(self, length):
        self.replica.truncate(length)
        if length < len(self.model):
            del self.model[length:]
        else:
            self.model.extend(bytes(length - len(self.model)))

    @rule(offset=st.one_of(st.integers(0, 900), st.integers(0, 3 * 4096)), size=st.integers(0, 5000))
    def read(self, offset, size):
        assert self.replica.read(offset, size) == bytes(self.model[offset : offset + size])

    @rule()
    def reopen(self):
        self.replica.close()
        self.replica = self.volume.open_replica(BLOCK, self.gs, writable=True)

    @rule()
    def reopen_volume(self):
        """A fresh volume object must count exactly what the old one kept up to date."""
        self.replica.close()
        self.volume = reopen(self.volume)
        self.replica = self.volume.open_replica(BLOCK, self.gs, writable=True)

    @rule()
    def bump_gs(self):
        self.gs += 1
        self.replica.set_gs(self.gs)

    @invariant()
    def files_match_model(self):
        if self.replica is None:
            return
        model = bytes(self.model)
        assert self.replica.length == len(model)
        assert self.replica.read(0, len(model) + 1) == model
        assert_replica_files(self.volume, BLOCK, self.gs, self.bpc, model)
        assert self.volume.used_bytes() == files_size(self.volume) == len(model) + meta.meta_size(len(model), self.bpc)
        assert self.replica.verified_length() == len(model)

    def teardown(self):
        replica_module.DIRECT_WRITE_BYTES = DIRECT_WRITE_BYTES
        if self.replica is not None:
            self.replica.close()
        self.tmp.cleanup()


ReplicaMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_replica_against_model = ReplicaMachine.TestCase


# ---------------------------------------------------------------------- corruption


def corrupt_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x40]))


def test_corrupt_byte_fails_only_its_chunk(volume):
    data = os.urandom(4 * 512)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
        corrupt_byte(volume.data_path(BLOCK), 2 * 512 + 7)
        for offset, size in [(2 * 512 + 7, 1), (2 * 512, 512), (0, 4 * 512), (1000, 100)]:
            with pytest.raises(ChecksumError) as e:
                r.read(offset, size)
            assert e.value.errno == errno.EIO
            assert str(volume.path) in str(e.value)
            assert f"block {BLOCK}" in str(e.value) and "chunk 2" in str(e.value)
        assert r.read(0, 1024) == data[:1024]
        assert r.read(3 * 512, 512) == data[3 * 512 :]
        assert r.read(1000, 24) == data[1000:1024]


@pytest.mark.parametrize("chunk", [0, 19, 20, 63, 299, 300])
def test_corrupt_byte_in_a_long_read_names_its_chunk(volume, chunk):
    """Reads of many chunks are checked through one combined CRC (crc_combine); damage
    anywhere in them, in the data or in the meta file, is still EIO naming the chunk."""
    data = os.urandom(300 * 512 + 100)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
        assert r.read(0, len(data)) == data
        corrupt_byte(volume.data_path(BLOCK), chunk * 512 + 50)
        with pytest.raises(ChecksumError, match=f"chunk {chunk}\\b") as e:
            r.read(0, len(data))
        assert e.value.errno == errno.EIO
        corrupt_byte(volume.data_path(BLOCK), chunk * 512 + 50)  # mended
        assert r.read(0, len(data)) == data
        corrupt_byte(volume.meta_path(BLOCK, GS), 7 + 4 * chunk + 1)
        with pytest.raises(ChecksumError, match=f"chunk {chunk}\\b"):
            r.read(100, len(data) - 150)
        far = 0 if chunk > 150 else 200 * 512
        assert r.read(far, 80 * 512) == data[far : far + 80 * 512]


def test_corrupt_crc_is_detected(volume):
    data = os.urandom(3 * 512)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
        corrupt_byte(volume.meta_path(BLOCK, GS), 7 + 4 * 1)
        with pytest.raises(ChecksumError, match="chunk 1"):
            r.read(600, 10)
        assert r.read(0, 512) == data[:512]


def test_partial_write_never_blesses_a_corrupt_chunk(volume):
    """Rewriting part of a corrupt chunk must fail, not store a fresh CRC over bad bytes."""
    data = os.urandom(2 * 512)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
        corrupt_byte(volume.data_path(BLOCK), 10)
        with pytest.raises(ChecksumError, match="chunk 0"):
            r.write(100, b"new")
        with pytest.raises(ChecksumError, match="chunk 0"):
            r.truncate(300)
        r.write(0, b"x" * 512)  # a whole-chunk write replaces the bad bytes: fine
        assert r.read(0, 1024) == b"x" * 512 + data[512:]


def test_append_keeps_a_corrupt_partial_chunk_detectable(volume):
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, b"a" * 100)
        corrupt_byte(volume.data_path(BLOCK), 50)
        r.write(100, b"b" * 100)  # continues the stored CRC, which still describes the good bytes
        with pytest.raises(ChecksumError):
            r.read(0, 10)


def test_short_meta_file_is_an_error(volume):
    with volume.create_replica(BLOCK, GS, 16) as r:
        r.write(0, b"z" * 64)
        os.truncate(volume.meta_path(BLOCK, GS), 7 + 4 * 2)
        assert r.read(0, 32) == b"z" * 32
        with pytest.raises(ChecksumError, match="no checksum for chunk 2"):
            r.read(40, 4)


# ---------------------------------------------------------------------- generation stamps


def test_set_gs_renames_the_meta_file(volume):
    with volume.create_replica(BLOCK, GS, 16) as r:
        r.write(0, b"version one")
        r.set_gs(GS + 5)
        assert r.gs == GS + 5
        assert volume.meta_gss(BLOCK) == [GS + 5]
        assert not volume.meta_path(BLOCK, GS).exists()
        r.write(11, b", two")
    assert_replica_files(volume, BLOCK, GS + 5, 16, b"version one, two")
    with pytest.raises(VolumeError):
        volume.open_replica(BLOCK, GS, writable=False)
    with volume.open_replica(BLOCK, GS + 5, writable=False) as r:
        assert r.read(0, 100) == b"version one, two"


def test_set_gs_refuses_to_overwrite_a_meta_file(volume):
    with volume.create_replica(BLOCK, GS, 16) as r:
        volume.meta_path(BLOCK, GS + 1).write_bytes(meta.header_bytes(16))
        with pytest.raises(VolumeError) as e:
            r.set_gs(GS + 1)
        assert e.value.errno == errno.EEXIST
        assert r.gs == GS


def test_meta_gss_lists_every_stamp(volume):
    assert volume.meta_gss(BLOCK) == []
    volume.create_replica(BLOCK, 1003, 16).close()
    volume.meta_path(BLOCK, 1001).write_bytes(meta.header_bytes(16))
    volume.meta_path(BLOCK + 10, 1002).write_bytes(meta.header_bytes(16))  # same directory, other block
    assert volume.meta_gss(BLOCK) == [1001, 1003]


# ---------------------------------------------------------------------- crash recovery


def torn_append(volume: Volume, block_id: int, data: bytes) -> None:
    """What a crash between the data write and the meta write leaves: data, no CRCs."""
    path = volume.data_path(block_id)
    with open(path, "ab") as f:
        f.write(data)


@pytest.mark.parametrize("acknowledged", [0, 100, 512, 700, 1024])
@pytest.mark.parametrize("torn", [1, 50, 412, 600, 3000])
def test_verified_length_after_torn_append(volume, acknowledged, torn):
    data = os.urandom(acknowledged)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
    torn_append(volume, BLOCK, os.urandom(torn))
    volume = reopen(volume)  # the daemon died: the next mount scans again
    with volume.open_replica(BLOCK, GS, writable=True) as r:
        assert r.length == acknowledged + torn
        assert r.verified_length() == acknowledged
        r.truncate(r.verified_length())
        assert r.read(0, 10_000) == data
        r.write(acknowledged, b"more")
        assert r.read(0, 10_000) == data + b"more"
    assert_replica_files(volume, BLOCK, GS, 512, data + b"more")
    assert reopen(volume).used_bytes() == volume.used_bytes() == files_size(volume)


def test_verified_length_after_torn_overwrite(volume):
    data = os.urandom(5 * 512)
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, data)
    with open(volume.data_path(BLOCK), "r+b") as f:
        f.seek(2 * 512 + 100)
        f.write(b"new bytes, old crc")
    with volume.open_replica(BLOCK, GS, writable=True) as r:
        assert r.verified_length() == 2 * 512


def test_verified_length_with_crcs_but_no_data(volume):
    """Meta written, data lost (power cut reordering): only fully covered chunks count."""
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, os.urandom(1500))
    os.truncate(volume.data_path(BLOCK), 1100)
    with volume.open_replica(BLOCK, GS, writable=True) as r:
        assert r.verified_length() == 1024


def test_verified_length_of_a_large_replica(volume):
    data = os.urandom(9 << 20)  # more than one recovery span
    with volume.create_replica(BLOCK, GS, 4096) as r:
        r.write(0, data)
        assert r.verified_length() == len(data)
    corrupt_byte(volume.data_path(BLOCK), (5 << 20) + 3)
    with volume.open_replica(BLOCK, GS, writable=False) as r:
        assert r.verified_length() == 5 << 20


# ---------------------------------------------------------------------- scans and accounting


def test_iter_replicas_finds_orphans(volume):
    volume.create_replica(BLOCK, GS, 16).close()  # complete
    with volume.create_replica(BLOCK + 1, GS, 16) as r:  # two meta files
        r.write(0, b"abc")
    volume.meta_path(BLOCK + 1, 1000).write_bytes(meta.header_bytes(16))
    volume.create_replica(BLOCK + 2, GS, 16).close()  # data without meta
    volume.meta_path(BLOCK + 2, GS).unlink()
    volume.create_replica(BLOCK + 70000, GS, 16).close()  # meta without data, other directory
    volume.data_path(BLOCK + 70000).unlink()
    (volume.data_path(BLOCK).parent / "notes.txt").write_text("not a replica")

    def at(bid, gs):
        return volume.meta_path(bid, gs) if gs is not None else None

    assert list(volume.iter_replicas()) == [
        ReplicaInfo(BLOCK, GS, volume.data_path(BLOCK), at(BLOCK, GS), 0, 7),
        ReplicaInfo(BLOCK + 1, 1000, volume.data_path(BLOCK + 1), at(BLOCK + 1, 1000), 3, 7),
        ReplicaInfo(BLOCK + 1, GS, volume.data_path(BLOCK + 1), at(BLOCK + 1, GS), 3, 11),
        ReplicaInfo(BLOCK + 2, None, volume.data_path(BLOCK + 2), None, 0, 0),
        ReplicaInfo(BLOCK + 70000, GS, None, at(BLOCK + 70000, GS), 0, 7),
    ]


def test_space_accounting_with_a_capacity(tmp_path):
    v = make_volume(tmp_path / "v", capacity=1 << 20)
    disk_free = shutil.disk_usage(tmp_path).free
    assert v.total_bytes() == 1 << 20
    assert v.free_bytes() == 1 << 20
    with v.create_replica(BLOCK, GS, 4096) as r:
        r.write(0, os.urandom(100_000))
    used = 100_000 + meta.meta_size(100_000, 4096)
    assert v.used_bytes() == used == files_size(v)
    assert v.free_bytes() == (1 << 20) - used
    assert v.has_room((1 << 20) - used) and not v.has_room((1 << 20) - used + 1)
    assert reopen(v).used_bytes() == used
    v.delete_replica(BLOCK, GS)
    assert v.used_bytes() == 0 and v.free_bytes() == 1 << 20
    assert abs(v.free_bytes() - min(1 << 20, disk_free)) <= 1 << 20


def test_space_accounting_without_a_capacity(volume):
    with volume.create_replica(BLOCK, GS, 512) as r:
        r.write(0, b"x" * 1000)
    disk_free = shutil.disk_usage(volume.path).free
    assert abs(volume.free_bytes() - disk_free) < 64 << 20  # other tests may be writing
    assert abs(volume.total_bytes() - (volume.used_bytes() + disk_free)) < 64 << 20
    assert volume.has_room(1) and not volume.has_room(1 << 62)


def test_delete_is_idempotent(volume):
    with volume.create_replica(BLOCK, GS, 16) as r:
        r.write(0, b"data")
    volume.meta_path(BLOCK, 999).write_bytes(meta.header_bytes(16))
    volume.delete_replica(BLOCK, GS)
    assert not volume.data_path(BLOCK).exists()
    assert volume.meta_gss(BLOCK) == [999]
    volume.delete_replica(BLOCK, GS)
    volume.delete_replica(BLOCK)
    volume.delete_replica(BLOCK)
    volume.delete_replica(BLOCK + 12345)
    assert list(volume.iter_replicas()) == []
    assert reopen(volume).used_bytes() == 0


def test_delete_while_open_stops_counting(volume):
    r = volume.create_replica(BLOCK, GS, 16)
    r.write(0, b"abc")
    volume.delete_replica(BLOCK)
    assert volume.used_bytes() == 0
    r.write(3, b"def")  # still works on the unlinked files, not counted
    assert r.read(0, 10) == b"abcdef"
    assert volume.used_bytes() == 0
    r.close()
    with volume.create_replica(BLOCK, GS + 1, 16) as fresh:  # a new replica gets fresh state
        assert fresh.length == 0


def test_install_replica_moves_a_copy_into_place(tmp_path, volume):
    source = make_volume(tmp_path / "disk0", StorageType.DISK, volume_id=2)
    with source.create_replica(BLOCK, GS, 16) as r:
        r.write(0, b"moving data")
    data_tmp, meta_tmp = volume.tmp_dir / "d", volume.tmp_dir / "m"
    shutil.copyfile(source.data_path(BLOCK), data_tmp)
    shutil.copyfile(source.meta_path(BLOCK, GS), meta_tmp)
    volume.install_replica(BLOCK, GS, data_tmp, meta_tmp)
    assert os.listdir(volume.tmp_dir) == []
    with volume.open_replica(BLOCK, GS, writable=False) as r:
        assert r.read(0, 100) == b"moving data"
    assert volume.used_bytes() == files_size(volume) == 11 + 11
    with pytest.raises(VolumeError) as e:
        volume.install_replica(BLOCK, GS, data_tmp, meta_tmp)
    assert e.value.errno == errno.EEXIST


def test_clear_tmp(volume):
    (volume.tmp_dir / "half-copied").write_bytes(b"x")
    (volume.tmp_dir / "dir").mkdir()
    assert volume.clear_tmp() == 2
    assert os.listdir(volume.tmp_dir) == []


def test_many_blocks_spread_over_directories(volume):
    ids = [BLOCK + i * 97 for i in range(600)]
    for bid in ids:
        volume.create_replica(bid, GS, 512).close()
    found = [info.block_id for info in volume.iter_replicas()]
    assert sorted(found) == ids
    assert len({volume.data_path(b).parent for b in ids}) == len({((b >> 16) & 0x1F, (b >> 8) & 0x1F) for b in ids})
    assert volume.used_bytes() == 7 * len(ids)


def test_block_ids_in_one_directory_are_not_confused(volume):
    """blk_1_... must not be read as a meta file of blk_1 when scanning blk_12's neighbours."""
    for bid in (1, 12, 123):
        volume.create_replica(bid, GS, 16).close()
    assert volume.meta_gss(1) == [GS]
    assert [i.block_id for i in volume.iter_replicas()] == [1, 12, 123]



# --- sync-behind writes ------------------------------------------------------------------------


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def cachestat(path, length: int, offset: int = 0) -> _CacheStat:
    """Page-cache state of ``length`` bytes of a file at ``offset`` (cachestat(2), Linux 6.5)."""
    libc = ctypes.CDLL(None, use_errno=True)
    span = (ctypes.c_uint64 * 2)(offset, length)
    stat = _CacheStat()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return stat


def dirty_pages(path, length: int) -> int:
    """Dirty page-cache pages of the file's first ``length`` bytes."""
    return cachestat(path, length).nr_dirty


def test_long_sequential_write_is_written_out_behind_the_writer(volume, tmp_path):
    """HDFS's sync-behind writes: the disk starts writing a replica's data while the writer
    goes on, so a later fsync has only the tail left. A plain file written the same way
    beside it stays dirty (the control: without it this test could not fail)."""
    from tierfs.backends.replica import SYNC_BEHIND_BYTES

    piece = os.urandom(DIRECT_WRITE_BYTES // 2)  # through the page cache
    total = 3 * SYNC_BEHIND_BYTES + len(piece)
    control = tmp_path / "control"
    with open(control, "wb") as f:
        for _ in range(total // len(piece)):
            f.write(piece)
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        for offset in range(0, total, len(piece)):
            replica.write(offset, piece)
        behind = 3 * SYNC_BEHIND_BYTES
        control_dirty = dirty_pages(control, behind)
        assert control_dirty > 0, "the kernel wrote the control out itself: nothing to compare"
        # Submitted pages are under writeback or clean, never dirty; the margin only covers
        # the kernel's own flusher picking up part of the control meanwhile.
        assert dirty_pages(volume.data_path(BLOCK), behind) < control_dirty / 4
        assert replica.read(behind - len(piece), 2 * len(piece)) == piece * 2


def test_writes_after_a_truncate_are_written_behind_again(volume):
    """A replica cut short and written again: the bytes behind the writer are handed to the
    disk again (the mark of what was written out follows the cut)."""
    from tierfs.backends.replica import SYNC_BEHIND_BYTES

    piece = os.urandom(DIRECT_WRITE_BYTES // 2)  # through the page cache
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        for offset in range(0, 2 * SYNC_BEHIND_BYTES, len(piece)):
            replica.write(offset, piece)
        replica.truncate(0)
        total = SYNC_BEHIND_BYTES + len(piece)
        for offset in range(0, total, len(piece)):
            replica.write(offset, piece)
        pages = SYNC_BEHIND_BYTES // 4096
        assert dirty_pages(volume.data_path(BLOCK), SYNC_BEHIND_BYTES) < pages / 4
        assert replica.read(0, len(piece)) == piece


# --- large writes: past the page cache ---------------------------------------------------------


def test_large_aligned_writes_skip_the_page_cache(volume, tmp_path):
    """Writes of DIRECT_WRITE_BYTES and more at page-aligned offsets reach the disk without
    leaving pages in the cache; smaller writes to a second replica beside it stay cached
    (the control). Both read back, and their CRCs are exact."""
    data = os.urandom(4 * DIRECT_WRITE_BYTES)
    for block_id, piece in ((BLOCK, DIRECT_WRITE_BYTES), (BLOCK + 1, DIRECT_WRITE_BYTES // 2)):
        with volume.create_replica(block_id, GS, 4096) as replica:
            for offset in range(0, len(data), piece):
                replica.write(offset, data[offset : offset + piece])
            assert replica.read(0, len(data)) == data
        assert_replica_files(volume, block_id, GS, 4096, data)
    assert cachestat(volume.data_path(BLOCK + 1), len(data)).nr_cache > 0
    direct = cachestat(volume.data_path(BLOCK), len(data))
    # the reads above cached some of it again: only the checks after the writes count
    assert direct.nr_dirty == 0 and direct.nr_writeback == 0


def test_large_write_replaces_what_the_page_cache_held(volume):
    """A direct write over pages that a small write left dirty and a read left cached: every
    later read sees the new bytes. An unaligned tail, and a large write at an unaligned
    offset, go through the page cache and land too."""
    size = 2 * DIRECT_WRITE_BYTES
    model = bytearray(os.urandom(size))
    with volume.create_replica(BLOCK, GS, 512) as replica:
        replica.write(0, bytes(model))  # direct
        replica.write(100, b"small, dirty")
        model[100:112] = b"small, dirty"
        assert replica.read(0, 4096) == model[:4096]  # cached now
        big = os.urandom(DIRECT_WRITE_BYTES + 300)  # direct, with a 300-byte tail
        replica.write(0, big)
        model[: len(big)] = big
        assert replica.read(0, size) == model
        odd = os.urandom(DIRECT_WRITE_BYTES)
        replica.write(size - 1000, odd)  # unaligned offset: page cache, and grows the file
        model[size - 1000 :] = odd
        assert replica.read(0, len(model)) == model
        replica.fsync()
    assert_replica_files(volume, BLOCK, GS, 512, bytes(model))


def test_writes_fall_back_to_the_page_cache_without_direct_io(volume, monkeypatch):
    """A filesystem that refuses O_DIRECT, at the open or (injected here) at the first
    write: the same writes go through the page cache, nothing is lost or written twice."""
    data = os.urandom(3 * DIRECT_WRITE_BYTES)
    monkeypatch.setattr(replica_module, "_open_direct", lambda fd: -1)
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        replica.write(0, data)
        assert replica.read(0, len(data)) == data
    assert_replica_files(volume, BLOCK, GS, 4096, data)
    monkeypatch.undo()

    real_pwrite_all = replica_module._pwrite_all
    refused = []

    def refuse_direct(fd, chunk, offset):
        if fcntl_flags(fd) & os.O_DIRECT:
            real_pwrite_all(fd, mmap.mmap(-1, len(chunk) // 2), offset)  # zeros land, then EINVAL
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite_all(fd, chunk, offset)

    monkeypatch.setattr(replica_module, "_pwrite_all", refuse_direct)
    with volume.create_replica(BLOCK + 1, GS, 4096) as replica:
        replica.write(0, data)
        replica.write(len(data), data)
        assert replica.read(0, 2 * len(data)) == data * 2
    assert refused == [0]  # given up after the first refusal
    assert_replica_files(volume, BLOCK + 1, GS, 4096, data * 2)


def test_direct_writes_resume_after_running_out_of_descriptors(volume, monkeypatch):
    """Out of descriptors (EMFILE) when the O_DIRECT descriptor is first wanted says nothing
    about the filesystem: that write goes through the page cache and the next large one
    opens it after all (it used to stay on the page cache until the replica was reopened)."""
    real_open = os.open
    refusals = []

    def out_of_descriptors_once(path, flags, *args):
        if flags & os.O_DIRECT and not refusals:
            refusals.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)

    data = os.urandom(2 * DIRECT_WRITE_BYTES)
    monkeypatch.setattr(os, "open", out_of_descriptors_once)
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        replica.write(0, data[:DIRECT_WRITE_BYTES])
        assert len(refusals) == 1 and cachestat(volume.data_path(BLOCK), len(data)).nr_dirty > 0
        replica.fsync()
        replica.write(DIRECT_WRITE_BYTES, data[DIRECT_WRITE_BYTES:])
        assert cachestat(volume.data_path(BLOCK), len(data)).nr_dirty == 0  # went direct
        assert replica.read(0, len(data)) == data
    assert_replica_files(volume, BLOCK, GS, 4096, data)


def fcntl_flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


# --- reads: page cache only, readahead ---------------------------------------------------------


def _cold_replica(volume, data: bytes, block_id: int = BLOCK):
    with volume.create_replica(block_id, GS, 4096) as replica:
        replica.write(0, data)
    for path in (volume.data_path(block_id), volume.meta_path(block_id, GS)):
        evict(path)
    return volume.open_replica(block_id, GS, writable=False)


def test_nowait_read_answers_only_from_the_page_cache(volume):
    """read(nowait=True) gives None for pages the disk would have to supply, and the
    verified bytes once they are cached; a read near the end of the data is clamped to it."""
    data = os.urandom(3 * 4096 + 100)
    with _cold_replica(volume, data) as replica:
        assert cachestat(volume.data_path(BLOCK), len(data)).nr_cache == 0
        assert replica.read(0, 4096, nowait=True) is None
        assert replica.read(0, len(data)) == data  # the slow way fills the cache
        assert bytes(replica.read(0, len(data), nowait=True)) == data
        assert bytes(replica.read(4000, 10_000, nowait=True)) == data[4000:]
        assert bytes(replica.read(len(data) - 50, 4096, nowait=True)) == data[-50:]


def test_nowait_read_does_not_wait_for_the_blocks_lock(volume):
    """Another thread holding the block's lock may be waiting for the disk under it: the
    event loop's read gives up at once rather than wait behind it."""
    data = os.urandom(4096)
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        replica.write(0, data)
        assert replica.read(0, 4096) == data  # cached, and no readahead due any more
        with replica._state.lock:  # what a reader in a worker thread holds during its pread
            assert replica.read(0, 4096, nowait=True) is None
        assert bytes(replica.read(0, 4096, nowait=True)) == data


def test_nowait_read_still_verifies_checksums(volume):
    data = os.urandom(2 * 4096)
    with volume.create_replica(BLOCK, GS, 4096) as replica:
        replica.write(0, data)
    with open(volume.data_path(BLOCK), "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" if data[5000] != 0xFF else b"\x00")
    with volume.open_replica(BLOCK, GS, writable=False) as replica:
        replica.read(0, 4096)  # the good chunk, and the page cache now holds the file
        with pytest.raises(ChecksumError):
            replica.read(4096, 4096, nowait=True)


# After a first 1 MiB read the kernel itself has read ahead at most four times that (its
# initial window), whatever the disk's read_ahead_kb; the checks look past it.
_PAST_KERNEL = (5 << 20, 4 << 20)  # (offset from the read, length)


def test_a_sequential_reader_has_the_data_ahead_of_it_read_early(volume):
    """HDFS's datanode readahead: right after the first read of a cold replica, the bytes
    past what the kernel reads ahead by itself are already in the page cache."""
    from tierfs.backends.replica import READ_AHEAD_BYTES

    piece = 1 << 20
    assert READ_AHEAD_BYTES + piece >= sum(_PAST_KERNEL)
    data = os.urandom(2 * READ_AHEAD_BYTES + 4 * piece)
    offset, length = _PAST_KERNEL
    with _cold_replica(volume, data) as replica:
        assert replica.read(0, piece) == data[:piece]
        assert cachestat(volume.data_path(BLOCK), length, offset).nr_cache > length // 4096 // 2


@pytest.mark.parametrize("first_try", ["nowait", "direct"])
def test_a_random_read_asks_for_nothing_ahead(volume, first_try):
    """A read far from where the last one ended asks for nothing ahead of it, also when it
    is tried from the page cache first (nowait, which misses) and then from the disk: the
    miss must not count as a read the second try continues."""
    from tierfs.backends.replica import READ_AHEAD_BYTES

    piece = 1 << 20
    data = os.urandom(2 * READ_AHEAD_BYTES + 16 * piece)
    offset, length = _PAST_KERNEL
    with _cold_replica(volume, data) as replica:
        # each more than READ_AHEAD_BYTES past where the read before it ended
        for far in (READ_AHEAD_BYTES + 2 * piece, 2 * READ_AHEAD_BYTES + 4 * piece):
            if first_try == "nowait":
                assert replica.read(far, piece, nowait=True) is None
            assert replica.read(far, piece) == data[far : far + piece]
            assert cachestat(volume.data_path(BLOCK), length, far + offset).nr_cache == 0
