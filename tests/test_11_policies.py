"""The policy suite against the worked tables of the HDFS reference (sections 1, 2 and 3.4).

Every expectation below is copied from ``shared/reference/hdfs-storage-policies.md``; a
failure here means tierfs places replicas differently from HDFS.
"""

from __future__ import annotations

import pytest

from tierfs.backends.storage_types import StorageType
from tierfs.fs.placement import replicas_placeable
from tierfs.satisfier.policies import (
    BlockStoragePolicy,
    PolicySuite,
    actual_policy,
    storage_type_summary,
)

SUITE = PolicySuite()


def types(spec: str) -> list[StorageType]:
    """'DISK, ARCHIVE x2' -> [DISK, ARCHIVE, ARCHIVE]; '' -> []."""
    out: list[StorageType] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, times = item.partition(" x")
        out += [StorageType.parse(name)] * int(times or 1)
    return out


# --- section 1: the table --------------------------------------------------------------

TABLE = [
    # id, name, storage types, creation fallbacks, replication fallbacks, copy on create
    (15, "LAZY_PERSIST", "RAM_DISK, DISK", "DISK", "DISK", True),
    (14, "ALL_NVDIMM", "NVDIMM", "DISK", "DISK", False),
    (12, "ALL_SSD", "SSD", "DISK", "DISK", False),
    (10, "ONE_SSD", "SSD, DISK", "SSD, DISK", "SSD, DISK", False),
    (7, "HOT", "DISK", "", "ARCHIVE", False),
    (5, "WARM", "DISK, ARCHIVE", "DISK, ARCHIVE", "DISK, ARCHIVE", False),
    (2, "COLD", "ARCHIVE", "", "", False),
    (1, "PROVIDED", "PROVIDED, DISK", "PROVIDED, DISK", "PROVIDED, DISK", False),
]


@pytest.mark.parametrize("pid, name, stypes, creation, replication, copy", TABLE)
def test_builtin_table(pid, name, stypes, creation, replication, copy):
    policy = SUITE.get(name)
    assert policy == SUITE.get(pid)
    assert (policy.id, policy.name) == (pid, name)
    assert list(policy.storage_types) == types(stypes)
    assert list(policy.creation_fallbacks) == types(creation)
    assert list(policy.replication_fallbacks) == types(replication)
    assert policy.copy_on_create_file is copy


def test_listing_order_is_ascending_id():
    assert [p.name for p in SUITE.all_policies()] == [
        "PROVIDED", "COLD", "WARM", "HOT", "ONE_SSD", "ALL_SSD", "ALL_NVDIMM", "LAZY_PERSIST"]


def test_lookup_ignores_case():
    assert SUITE.get("hot") is SUITE.get("HOT") is SUITE.get("Hot")
    assert SUITE.get("all_nvdimm").id == 14
    assert SUITE.get("lazy_Persist").id == 15


@pytest.mark.parametrize("bad", ["HOTT", "", "7", "ALL SSD", "hot "])
def test_unknown_name(bad):
    with pytest.raises(ValueError, match=f"^Cannot find a block policy with the name {bad}$"):
        SUITE.get(bad)


@pytest.mark.parametrize("bad", [3, 16, -1])
def test_unknown_id(bad):
    with pytest.raises(ValueError, match="Cannot find a block policy"):
        SUITE.get(bad)


def test_id_zero_is_the_default():
    assert SUITE.default.name == "HOT"
    assert SUITE.get(0) is SUITE.get("HOT")
    cold = PolicySuite(default_name="cold")
    assert cold.default is cold.get(0) is cold.get("COLD")
    with pytest.raises(ValueError):
        PolicySuite(default_name="LUKEWARM")


TO_STRING = {
    "PROVIDED": "BlockStoragePolicy{PROVIDED:1, storageTypes=[PROVIDED, DISK], "
                "creationFallbacks=[PROVIDED, DISK], replicationFallbacks=[PROVIDED, DISK]}",
    "COLD": "BlockStoragePolicy{COLD:2, storageTypes=[ARCHIVE], creationFallbacks=[], "
            "replicationFallbacks=[]}",
    "WARM": "BlockStoragePolicy{WARM:5, storageTypes=[DISK, ARCHIVE], "
            "creationFallbacks=[DISK, ARCHIVE], replicationFallbacks=[DISK, ARCHIVE]}",
    "HOT": "BlockStoragePolicy{HOT:7, storageTypes=[DISK], creationFallbacks=[], "
           "replicationFallbacks=[ARCHIVE]}",
    "ONE_SSD": "BlockStoragePolicy{ONE_SSD:10, storageTypes=[SSD, DISK], "
               "creationFallbacks=[SSD, DISK], replicationFallbacks=[SSD, DISK]}",
    "ALL_SSD": "BlockStoragePolicy{ALL_SSD:12, storageTypes=[SSD], creationFallbacks=[DISK], "
               "replicationFallbacks=[DISK]}",
    "ALL_NVDIMM": "BlockStoragePolicy{ALL_NVDIMM:14, storageTypes=[NVDIMM], "
                  "creationFallbacks=[DISK], replicationFallbacks=[DISK]}",
    "LAZY_PERSIST": "BlockStoragePolicy{LAZY_PERSIST:15, storageTypes=[RAM_DISK, DISK], "
                    "creationFallbacks=[DISK], replicationFallbacks=[DISK]}",
}


@pytest.mark.parametrize("name", TO_STRING)
def test_to_string(name):
    assert str(SUITE.get(name)) == TO_STRING[name]


# --- section 2.3: chooseStorageTypes(n) -------------------------------------------------

TABLE_2_3 = [
    ("HOT", "DISK", "DISK x2", "DISK x3"),
    ("WARM", "DISK", "DISK, ARCHIVE", "DISK, ARCHIVE x2"),
    ("COLD", "ARCHIVE", "ARCHIVE x2", "ARCHIVE x3"),
    ("ONE_SSD", "SSD", "SSD, DISK", "SSD, DISK x2"),
    ("ALL_SSD", "SSD", "SSD x2", "SSD x3"),
    ("ALL_NVDIMM", "NVDIMM", "NVDIMM x2", "NVDIMM x3"),
    ("LAZY_PERSIST", "DISK", "DISK x2", "DISK x3"),
    ("PROVIDED", "PROVIDED", "PROVIDED, DISK", "PROVIDED, DISK x2"),
]


@pytest.mark.parametrize("name, n1, n2, n3", TABLE_2_3)
def test_choose_storage_types_table(name, n1, n2, n3):
    policy = SUITE.get(name)
    for n, want in ((1, n1), (2, n2), (3, n3)):
        assert policy.choose_storage_types(n) == types(want), (name, n)
        # With nothing unavailable the four-argument form agrees, for both kinds of block.
        assert policy.choose_storage_types(n, (), (), True) == types(want)
    assert policy.choose_storage_types(0) == []


# --- section 2.4: 3 replicas, one of the policy's own types unavailable -----------------

TABLE_2_4 = [
    ("HOT", "DISK", "", "ARCHIVE x3"),
    ("WARM", "DISK", "ARCHIVE x3", "ARCHIVE x3"),
    ("WARM", "ARCHIVE", "DISK x3", "DISK x3"),
    ("COLD", "ARCHIVE", "", ""),
    ("ONE_SSD", "SSD", "DISK x3", "DISK x3"),
    ("ONE_SSD", "DISK", "SSD x3", "SSD x3"),
    ("ALL_SSD", "SSD", "DISK x3", "DISK x3"),
    ("ALL_NVDIMM", "NVDIMM", "DISK x3", "DISK x3"),
    ("LAZY_PERSIST", "DISK", "", ""),
    ("PROVIDED", "PROVIDED", "DISK x3", "DISK x3"),
    ("PROVIDED", "DISK", "PROVIDED x3", "PROVIDED x3"),
]


@pytest.mark.parametrize("name, unavailable, new_block, replication", TABLE_2_4)
def test_fallback_table(name, unavailable, new_block, replication):
    policy = SUITE.get(name)
    gone = set(types(unavailable))
    assert policy.choose_storage_types(3, [], gone, is_new_block=True) == types(new_block)
    assert policy.choose_storage_types(3, [], gone, is_new_block=False) == types(replication)


def test_only_the_first_available_fallback_is_used():
    # ONE_SSD with SSD and DISK both gone has no fallback left: nothing can be placed.
    one_ssd = SUITE.get("ONE_SSD")
    assert one_ssd.choose_storage_types(3, [], {StorageType.SSD, StorageType.DISK}) == []
    # WARM with DISK gone: every slot gets the same first available fallback, ARCHIVE.
    warm = SUITE.get("WARM")
    assert warm.choose_storage_types(2, [], {StorageType.DISK}) == types("ARCHIVE x2")


# --- section 2.4: examples with existing replicas ---------------------------------------

def test_warm_with_two_disk_replicas():
    warm = SUITE.get("WARM")
    chosen = types("DISK x2")
    # The second DISK is excess: only one more replica, ARCHIVE (twice listed, expected=1).
    assert warm.choose_storage_types(3, chosen) == types("ARCHIVE x2")
    assert warm.choose_storage_types(3, chosen, set(), False) == types("ARCHIVE x2")


def test_warm_with_two_disk_replicas_archive_unavailable():
    warm = SUITE.get("WARM")
    got = warm.choose_storage_types(3, types("DISK x2"), {StorageType.ARCHIVE}, False)
    assert got == types("DISK")


def test_hot_with_an_archive_replica():
    hot = SUITE.get("HOT")
    # ARCHIVE is excess and matches nothing, so the list comes back unchanged.
    assert hot.choose_storage_types(3, types("ARCHIVE")) == types("DISK x3")
    assert hot.choose_storage_types(3, types("ARCHIVE"), set(), True) == types("DISK x3")


def test_existing_replicas_cancel_wanted_slots():
    one_ssd = SUITE.get("ONE_SSD")
    assert one_ssd.choose_storage_types(3, types("DISK")) == types("SSD, DISK")
    assert one_ssd.choose_storage_types(3, types("SSD, DISK x2")) == []
    # An excess replica cancels only a slot of its own type: the SSD slot fell back to
    # DISK, so the ARCHIVE replica cancels nothing.
    got = one_ssd.choose_storage_types(3, types("ARCHIVE"), {StorageType.SSD}, False)
    assert got == types("DISK x3")


def test_an_excess_replica_stands_in_for_a_fallback():
    # HOT, DISK unavailable for replication: the slots fall back to ARCHIVE, and the
    # existing (excess) ARCHIVE replica counts as one of them.
    hot = SUITE.get("HOT")
    got = hot.choose_storage_types(3, types("ARCHIVE"), {StorageType.DISK}, False)
    assert got == types("ARCHIVE x2")


# --- chooseExcess ------------------------------------------------------------------------

@pytest.mark.parametrize("name, n, chosen, excess", [
    ("HOT", 3, "DISK x3", ""),
    ("HOT", 3, "DISK x3, ARCHIVE", "ARCHIVE"),
    ("HOT", 2, "DISK x3", "DISK"),
    ("HOT", 3, "ARCHIVE, DISK, SSD", "ARCHIVE, SSD"),
    ("WARM", 3, "DISK x2, ARCHIVE", "DISK"),
    ("WARM", 3, "DISK, ARCHIVE x2", ""),
    ("COLD", 2, "DISK, ARCHIVE x2", "DISK"),
    ("ONE_SSD", 3, "SSD x2, DISK", "SSD"),
    ("LAZY_PERSIST", 1, "RAM_DISK, DISK", "RAM_DISK"),
])
def test_choose_excess(name, n, chosen, excess):
    assert SUITE.get(name).choose_excess(n, types(chosen)) == types(excess)


# --- section 3.4: fsck -storagepolicies --------------------------------------------------

@pytest.mark.parametrize("replicas, policy", [
    ("DISK x3", "HOT"),
    ("DISK", "HOT"),
    ("ARCHIVE, DISK x2", None),          # DISK:2,ARCHIVE:1 matches nothing
    ("ARCHIVE x2, DISK", "WARM"),        # order of the replicas does not matter
    ("DISK, ARCHIVE", "WARM"),
    ("SSD, DISK x2", "ONE_SSD"),
    ("SSD x3", "ALL_SSD"),
    ("SSD", "ALL_SSD"),
    ("SSD x2, DISK", None),
    ("ARCHIVE x3", "COLD"),
    ("NVDIMM x2", "ALL_NVDIMM"),
    ("RAM_DISK", None),
    ("RAM_DISK, DISK", "LAZY_PERSIST"),
    ("PROVIDED x2, DISK", "PROVIDED"),   # sorted policy types are [DISK, PROVIDED]
    ("PROVIDED, DISK x2", None),         # ... so the extra replicas must be PROVIDED
    ("", None),
])
def test_actual_policy(replicas, policy):
    got = actual_policy(types(replicas), SUITE)
    assert (got.name if got else None) == policy


@pytest.mark.parametrize("replicas, summary", [
    ("ARCHIVE x2, DISK", "DISK:1,ARCHIVE:2"),
    ("DISK, SSD, RAM_DISK, DISK", "RAM_DISK:1,SSD:1,DISK:2"),
    ("PROVIDED, NVDIMM", "NVDIMM:1,PROVIDED:1"),
    ("", ""),
])
def test_storage_type_summary(replicas, summary):
    assert storage_type_summary(types(replicas)) == summary


def test_policies_are_immutable_values():
    hot = SUITE.get("HOT")
    with pytest.raises(AttributeError):
        hot.name = "COLD"  # type: ignore[misc]
    assert hot == BlockStoragePolicy(7, "HOT", (StorageType.DISK,), (), (StorageType.ARCHIVE,))
    assert hash(hot) == hash(SUITE.get(7))


# --- how many replicas a layout can keep at all ---------------------------------------------

DEFAULT_LAYOUT = "SSD, DISK, ARCHIVE"


@pytest.mark.parametrize("name, layout, replication, most", [
    ("HOT", DEFAULT_LAYOUT, 1, 1),
    ("HOT", DEFAULT_LAYOUT, 3, 2),        # DISK, then ARCHIVE (its replication fallback)
    ("HOT", "DISK x3", 3, 3),
    ("HOT", "SSD x3", 2, 0),              # neither DISK nor ARCHIVE
    ("COLD", DEFAULT_LAYOUT, 2, 1),       # ARCHIVE only, no fallback
    ("WARM", "DISK, ARCHIVE x2", 3, 3),
    ("ONE_SSD", DEFAULT_LAYOUT, 3, 2),    # SSD and DISK; never ARCHIVE
    ("ALL_SSD", "SSD x2, DISK", 3, 3),    # the third on its fallback, DISK
    ("LAZY_PERSIST", "RAM_DISK, DISK", 2, 1),  # RAM_DISK is transient: counts for nothing
])
def test_replicas_placeable_one_per_volume(name, layout, replication, most):
    """The most persistent replicas a policy keeps on a layout, one per volume, following
    the same fallbacks as re-replication: what mkfs warns of and ``satisfied`` says when
    a replication can never be met."""
    assert replicas_placeable(SUITE.get(name), replication, types(layout)) == most
