"""`shardlab verify` (the CI subset): each layout's losses and parameters equal the single-process
reference to 1e-10, and a wrong engine is caught (the check can fail)."""
from shardlab.analysis import verify
from shardlab.cli import main as cli_main
from shardlab.train.data import prepare


def test_verify_subset_passes(capsys):
    rc = cli_main(["verify", "--nproc", "2", "--layouts", "dp,zero2,fsdp,tp2-sp,pp2-zb,cp2,ep2,tp2-sp-ac-op"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("| pass |") == 8 and "8 passed, 0 failed" in out


def test_verify_can_fail():
    """A layout passes against the true reference and fails against a reference perturbed by
    1e-6 in one parameter: the comparison is real."""
    row = verify.run_layout("dp", 1, str(prepare(verify.layout_config("dp", 1).data)), 2, {})
    assert row["ok"], row
    cfg = verify.layout_config("dp", 1, 2)
    losses, params = verify.reference(cfg, str(prepare(cfg.data)), 2)
    key = next(iter(params))
    params[key] = params[key] + 1e-6
    row = verify.run_layout("dp", 1, str(prepare(cfg.data)), 2, {verify.reference_key(cfg): (losses, params)})
    assert not row["ok"] and row["param_diff"] >= 1e-6


def test_unknown_layout_is_a_clear_error(capsys):
    assert cli_main(["verify", "--layouts", "dp,tp9"]) == 2
    assert "unknown layout 'tp9'" in capsys.readouterr().err


def test_verify_on_the_process_group(capsys):
    """The subset above runs on the default transport (shared memory, for CPU ranks on one
    x86-64 host: SharedComm, with tp2-sp-ac-op's collectives inside blocks the ``op`` policy
    replays, pp2-zb's and cp2's point-to-point through the shared-memory rings). `--transport
    process_group` keeps gloo's paths equal to the reference too: DDP's and ZeRO's asynchronous
    bucket reductions that really run on gloo's thread, FSDP's prefetch, point-to-point through
    the process group (pp2-dualpipe: both directions at once; cp2: ring attention), all-to-all
    (ep2). The whole matrix on both: benchmarks/results/verify_n4.md, verify_shared_n4.md."""
    layouts = "dp,zero2,fsdp,tp2-sp-ac-op,ep2,pp2-dualpipe,cp2"
    rc = cli_main(["verify", "--nproc", "2", "--layouts", layouts, "--transport", "process_group"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--parallel.comm_transport=process_group" in out and "7 passed, 0 failed" in out


def test_verify_two_tier_layouts():
    """Expert parallel over simulated nodes: the hierarchical dispatch (ep4 over 2 nodes x 2
    ranks; with a capacity; with dp; with pp), node-limited routing (M = 1 of 2 groups), the
    overlapped dispatches (flat and hierarchical over 2 nodes, two chunks; inside DualPipe's
    stages) and DualPipe's F&B pairs run as lanes (dualpipe with the hierarchical dispatch over 4
    nodes; dualpipe, dualpipev), each equal to the single-process model (docs/expert-parallel.md,
    Two tiers). One spawn for all; the last three span no nodes."""
    names = ["ep4-hier", "ep4-hier-cap", "ep4-hier-m1", "ep2-hier-dp", "pp2-ep2-hier", "ep4-overlap",
             "ep4-hier-overlap", "pp2-dualpipe-ep2-hier-fb", "pp2-dualpipe-ep2-overlap", "pp2-dualpipe-ep2-fb",
             "pp2-dualpipev-ep2-fb"]
    cfg = verify.layout_config(names[0], 4)
    rows = verify.run_layouts(names, 4, str(prepare(cfg.data)), 2, {})
    assert all(r["ok"] for r in rows), rows
    assert all("over 2 nodes" in r["detail"] or "over 4 nodes" in r["detail"] for r in rows[:-3])
    assert all("F&B lanes" in r["detail"] for r in rows if r["layout"].endswith("-fb")), rows


def test_verify_comm_thread_flag():
    """`--comm-thread` sets parallel.comm_thread in every layout (the whole matrix with it:
    docs/collectives.md, The communication thread); alone it leaves the transport as it is."""
    from argparse import Namespace

    from shardlab.commands.verify_cmd import overrides
    assert overrides(Namespace(comm_thread=True, transport=None, overrides=[], arch="llama")) == \
        {"parallel": {"comm_thread": True}}
    assert overrides(Namespace(comm_thread=False, transport="shared", overrides=[], arch="llama")) == \
        {"parallel": {"comm_transport": "shared"}}
