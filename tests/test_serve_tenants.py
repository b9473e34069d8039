"""The tenants file of `kvsched serve`: the documented shape is accepted, every
mistake is refused naming the tenant and the field, keys authenticate (and only
their own tenant), and a reload applies adds, updates and removals live."""

from __future__ import annotations

import pytest

import kvsched
from kvsched.serve.tenants import TenantRegistry, TenantsError, load_tenants, parse_tenants

from helpers import ids

EXAMPLE = """
[[tenant]]
name = "gold"
api_key = "sk-gold-123"
tier = 0
kv_floor_blocks = 64      # optional, like every field below
kv_cap_blocks = 4096
max_concurrent = 64
rate_tokens_per_s = 50000
burst_tokens = 100000
weight = 1.0
prefix_namespace = "team" # optional

[[tenant]]
name = "bulk"
api_key = "sk-bulk-456"
tier = 1
"""


def write(tmp_path, text: str):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def scheduler() -> kvsched.Scheduler:
    return kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=129, block_size=16))


def test_the_documented_shape_becomes_tenant_configs(tmp_path):
    entries = load_tenants(write(tmp_path, EXAMPLE))
    assert [e.name for e in entries] == ["gold", "bulk"]
    assert entries[0].config == kvsched.TenantConfig(
        "gold", tier=0, kv_floor_blocks=64, kv_cap_blocks=4096, max_concurrent=64,
        rate_tokens_per_s=50000.0, burst_tokens=100000.0, weight=1.0, prefix_namespace="team",
    )  # fmt: skip
    assert entries[1].config == kvsched.TenantConfig("bulk", tier=1)
    assert "sk-gold" not in repr(entries[0]), "keys are never shown"


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('[[tenant]]\nname = "a"\napi_key = "k"\ntierr = 1\n', ["'a'", "unknown field 'tierr'"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\ntier = "0"\n', ["'a'", "tier", "integer"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\ntier = true\n', ["tier", "integer"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\nweight = "1"\n', ["weight", "number"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\nkv_cap_blocks = 1.5\n', ["kv_cap_blocks"]),
        ('[[tenant]]\nname = "a"\napi_key = 5\n', ["api_key", "string"]),
        ('[[tenant]]\nname = "a"\n', ["'a'", "api_key is missing"]),
        ('[[tenant]]\napi_key = "k"\n', ["tenant #1", "name is missing"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\nweight = -1.0\n', ["'a'", "weight"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\ntier = -1\n', ["'a'", "tier", "range"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\n[[tenant]]\nname = "a"\napi_key = "j"\n',
         ["'a'", "twice"]),
        ('[[tenant]]\nname = "a"\napi_key = "k"\n[[tenant]]\nname = "b"\napi_key = "k"\n',
         ["'b'", "also a key of tenant 'a'"]),
        ('[[tenant]]\nname = "a"\napi_key = "k\u00e9y"\n', ["'a'", "printable ASCII",
                                                         "character 2"]),
        ('[[tenant]]\nname = "a"\napi_keys = ["ok", "k\\t"]\n', ["printable ASCII"]),
        ('[[tenant]]\nname = "a"\napi_key = "k "\n', ["'a'", "begin or end with a space"]),
        ('[[tenant]]\nname = "a"\napi_key = " k"\n', ["begin or end with a space"]),
        ('tenants = 1\n', ["unknown top-level key 'tenants'"]),
        ("", ["no tenants"]),
        ("[[tenant]\n", ["not valid TOML"]),
    ],
)  # fmt: skip
def test_mistakes_are_refused_naming_the_field(tmp_path, toml, words):
    with pytest.raises(TenantsError) as err:
        load_tenants(write(tmp_path, toml))
    for w in words:
        assert w in str(err.value)
    assert '"k"' not in str(err.value) and "'k'" not in str(err.value), "no key in messages"


def test_a_reload_that_only_changes_keys_says_so(tmp_path):
    path = write(tmp_path, '[[tenant]]\nname = "a"\napi_key = "sk-old"\n')
    sched = scheduler()
    reg = TenantRegistry.from_file(path)
    reg.apply(sched)
    write(tmp_path, '[[tenant]]\nname = "a"\napi_keys = ["sk-new"]\n')
    assert reg.reload(sched).summary() == "API keys changed a"  # was "no changes"
    assert reg.authenticate("sk-new") == "a" and reg.authenticate("sk-old") is None


def test_keys_authenticate_their_own_tenant_only():
    reg = TenantRegistry(parse_tenants({"tenant": [
        {"name": "a", "api_key": "sk-a"},
        {"name": "b", "api_keys": ["sk-b1", "sk-b2"]},
    ]}))  # fmt: skip
    reg.apply(scheduler())
    assert reg.authenticate("sk-a") == "a"
    assert reg.authenticate("sk-b1") == reg.authenticate("sk-b2") == "b"
    for bad in (None, "", "sk-", "sk-a ", "SK-A", "sk-b1sk-b2", "x" * 10_000):
        assert reg.authenticate(bad) is None


def test_reload_adds_updates_and_removes_live(tmp_path):
    path = write(tmp_path, EXAMPLE)
    sched = scheduler()
    reg = TenantRegistry.from_file(path)
    first = reg.apply(sched)
    assert first.added == ["gold", "bulk"]
    assert sched.tenant("gold").kv_cap_blocks == 4096
    # bulk has a live request: its removal waits; its key stops working at once.
    rid = sched.submit("bulk", ids(8), 4)
    gold_only = EXAMPLE.split('[[tenant]]\nname = "bulk"')[0]
    changed = gold_only.replace("kv_cap_blocks = 4096", "kv_cap_blocks = 100")
    path.write_text(changed + '[[tenant]]\nname = "new"\napi_key = "sk-new"\n')
    report = reg.reload(sched)
    assert (report.added, report.updated, report.pending_removal) == (["new"], ["gold"], ["bulk"])
    assert sched.tenant("gold").kv_cap_blocks == 100
    assert reg.authenticate("sk-new") == "new" and reg.authenticate("sk-bulk-456") is None
    assert sched.tenant("bulk") is not None
    sched.cancel(rid)
    assert reg.retry_removals(sched).removed == ["bulk"]
    with pytest.raises(kvsched.UnknownTenant):
        sched.tenant("bulk")
    assert reg.reload(sched).summary() == "no changes"


def test_a_bad_file_on_reload_changes_nothing(tmp_path):
    path = write(tmp_path, EXAMPLE)
    sched = scheduler()
    reg = TenantRegistry.from_file(path)
    reg.apply(sched)
    before = (sched.tenant("gold"), sched.tenant("bulk"))
    path.write_text(EXAMPLE.replace("tier = 1", 'tier = "one"'))
    with pytest.raises(TenantsError, match="'bulk': tier must be an integer"):
        reg.reload(sched)
    assert (sched.tenant("gold"), sched.tenant("bulk")) == before
    assert reg.authenticate("sk-bulk-456") == "bulk"


def test_the_scheduler_table_becomes_scheduler_config_keywords(tmp_path):
    from kvsched.serve.tenants import load_scheduler_table

    path = write(tmp_path, EXAMPLE + '\n[scheduler]\npreempt_lower_tiers = false\n'
                 'max_num_seqs = 32\nladder = "off"\nadmission = "overcommit"\n'
                 "watermark_blocks = 4\noverhead_reserve = 0.05\n")  # fmt: skip
    assert load_scheduler_table(path) == {
        "preempt_lower_tiers": False, "max_num_seqs": 32, "ladder": [],
        "admission": "overcommit", "watermark_blocks": 4, "overhead_reserve": 0.05,
    }  # fmt: skip
    assert load_tenants(path), "the tenants beside it still parse"
    assert load_scheduler_table(write(tmp_path, EXAMPLE)) == {}


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ("max_num_seq = 4", ["unknown knob 'max_num_seq'", "max_num_seqs"]),
        ("max_num_seqs = 1.5", ["max_num_seqs must be an integer"]),
        ("preempt_lower_tiers = 1", ["preempt_lower_tiers must be true or false"]),
        ('ladder = "sometimes"', ["ladder", "default", "off"]),
        ('admission = "greedy"', ["[scheduler]", "admission"]),
        ("max_num_seqs = 0", ["[scheduler]", "max_num_seqs"]),
    ],
)
def test_scheduler_table_mistakes_are_refused_naming_the_knob(tmp_path, table, words):
    from kvsched.serve.tenants import load_scheduler_table

    with pytest.raises(TenantsError) as err:
        load_scheduler_table(write(tmp_path, EXAMPLE + f"\n[scheduler]\n{table}\n"))
    for w in words:
        assert w in str(err.value)
