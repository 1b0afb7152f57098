"""The experiment modes: which environment and flags each vLLM instance gets.

One table shared by the equivalence harness and the transfer benchmark, so that a mode
name means exactly the same configuration in both.

Environment contract (see experiments/README.md):
- kvcached on:   ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1, plus KVCACHED_CONTIGUOUS_LAYOUT=false
                 (required by kvcached's NIXL path) and a unique KVCACHED_IPC_NAME per instance;
- kvcached_pd:   active when kvcached is on and the package is importable; KVCACHED_PD=0 turns it
                 off entirely (then only kvcached 0.1.6's own NIXL patch applies);
                 KVCACHED_PD_TRANSPORT=staged|direct picks the data path (always set explicitly,
                 the default may change);
- wire:          KVCACHED_PD_WIRE=nixl|ipc forces how a staged extent reaches D (a NIXL READ, or
                 D reading P's staging through CUDA IPC); unset, kvcached-pd's default (auto:
                 IPC where D can open P's staging, NIXL otherwise) decides per peer, and D's
                 log says which wire serves each peer;
- test only:     KVCACHED_PD_TEST_CORRUPT=1 makes the decode side flip bits in one received block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Environment variables a mode may set. Any inherited value of these is removed before a
# mode's own values are applied, so the caller's shell cannot leak into a mode.
MANAGED_ENV_PREFIXES = ("KVCACHED_", "ENABLE_KVCACHED")

KVCACHED_OFF = {"ENABLE_KVCACHED": "false", "KVCACHED_PD": "0"}
KVCACHED_OWN = {
    "ENABLE_KVCACHED": "true",
    "KVCACHED_AUTOPATCH": "1",
    "KVCACHED_CONTIGUOUS_LAYOUT": "false",
    "KVCACHED_PD": "0",
}


def kvcached_pd_env(transport: str, corrupt: bool = False) -> dict[str, str]:
    env = dict(KVCACHED_OWN, KVCACHED_PD="1", KVCACHED_PD_TRANSPORT=transport)
    if corrupt:
        env["KVCACHED_PD_TEST_CORRUPT"] = "1"
    return env


@dataclass(frozen=True)
class InstanceConfig:
    """Configuration of one vLLM instance within a mode."""

    flavor: str  # short human label: vanilla | kvcached-own | kvcached-pd-staged | ...
    env: dict[str, str]
    block_size: int = 16
    # vLLM serve flags of this instance alone (after the harness's common ones, before the
    # run's --extra-serve-args), e.g. a prefill instance's --no-async-scheduling
    serve_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mode:
    name: str
    description: str
    prefill: InstanceConfig | None = None  # PD modes: P on the prefill GPU
    decode: InstanceConfig | None = None  # PD modes: D on the decode GPU
    single: InstanceConfig | None = None  # the no-PD reference instance
    connector: str = "NixlConnector"
    # The negative control must come out DIFFERENT from the reference and, above all,
    # from ``clean_twin``: the same configuration without the corruption, so that a
    # difference cannot come from PD numerics alone.
    expect_different: bool = False
    clean_twin: str | None = None
    # Optional modes (features that may not run at all, e.g. push) do not fail the
    # harness when their servers or requests fail; a silently wrong answer still does.
    optional: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_pd(self) -> bool:
        return self.single is None


def _pd(name: str, description: str, p: InstanceConfig, d: InstanceConfig, **kw) -> Mode:
    return Mode(name=name, description=description, prefill=p, decode=d, **kw)


VANILLA = InstanceConfig("vanilla", KVCACHED_OFF)
# In a mixed fleet both sides must agree on the KV layout (vLLM's handshake checks it);
# kvcached can only be NHD, so the plain-vLLM side is told NHD too.
VANILLA_NHD = InstanceConfig("vanilla-nhd", dict(KVCACHED_OFF, VLLM_KV_CACHE_LAYOUT="NHD"))
OWN = InstanceConfig("kvcached-own", KVCACHED_OWN)
PD_DIRECT = InstanceConfig("kvcached-pd-direct", kvcached_pd_env("direct"))
PD_STAGED = InstanceConfig("kvcached-pd-staged", kvcached_pd_env("staged"))
# Benchmark-only variants that attribute the staged path's time:
# - no spin: D notices a finished READ only at its next engine step (vLLM's polling);
# - prealloc: kvcached keeps 64-96 pages mapped ahead (its own KVCACHED_*_RESERVED_PAGES;
#   default 5-10), so allocating a request's blocks maps no memory on the critical path.
#   A kvcached page is 2 MiB in every layer's K and V: 128 MiB for the 32-layer bench
#   model, so 64 pages hold 8 GiB mapped while idle. That is the elasticity it costs.
PREALLOC_PAGES = {"KVCACHED_MIN_RESERVED_PAGES": "64", "KVCACHED_MAX_RESERVED_PAGES": "96"}
PD_STAGED_NOSPIN = InstanceConfig("kvcached-pd-staged-nospin",
                                  dict(kvcached_pd_env("staged"), KVCACHED_PD_READ_SPIN_US="0"))
PD_STAGED_PREALLOC = InstanceConfig("kvcached-pd-staged-prealloc",
                                    dict(kvcached_pd_env("staged"), **PREALLOC_PAGES))
# kvcached's own default layout (contiguous: one compound page maps every layer), which
# the staged transport serves and the direct path refuses.
PD_STAGED_CONTIG = InstanceConfig(
    "kvcached-pd-staged-contiguous",
    {k: v for k, v in kvcached_pd_env("staged").items() if k != "KVCACHED_CONTIGUOUS_LAYOUT"})
# The same with the NIXL READ forced: on one host, what the staged transport costs when D
# does not read P's staging through CUDA IPC (the comparison the IPC wire is measured by).
PD_STAGED_CONTIG_NIXL = InstanceConfig("kvcached-pd-staged-contiguous-nixl",
                                       dict(PD_STAGED_CONTIG.env, KVCACHED_PD_WIRE="nixl"))
BENCH_ONLY = "bench-only"  # tag: left out of 'all' (the equivalence harness's default)

MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("reference", "one instance, no PD: the ground truth", single=VANILLA),
        _pd("vanilla", "PD, vLLM without kvcached", VANILLA, VANILLA),
        _pd("kvcached-own", "PD, kvcached 0.1.6's own NIXL patch (KVCACHED_PD=0)", OWN, OWN),
        _pd("kvcached-pd-direct", "PD, kvcached_pd with vLLM's own descriptors",
            PD_DIRECT, PD_DIRECT),
        _pd("kvcached-pd-staged", "PD, kvcached_pd staged transport", PD_STAGED, PD_STAGED),
        _pd("mixed-p", "kvcached+kvcached_pd (staged) on P only, vanilla D (NHD)",
            PD_STAGED, VANILLA_NHD),
        _pd("mixed-d", "vanilla P (NHD), kvcached+kvcached_pd (staged) on D only",
            VANILLA_NHD, PD_STAGED),
        _pd("push", "NixlPushConnector, kvcached_pd staged on both sides", PD_STAGED, PD_STAGED,
            connector="NixlPushConnector", optional=True),
        _pd("push-direct", "NixlPushConnector, kvcached_pd with vLLM's per-block WRITE",
            PD_DIRECT, PD_DIRECT, connector="NixlPushConnector", optional=True),
        _pd("push-vanilla",
            "NixlPushConnector without kvcached (tells vLLM's push apart from ours)",
            VANILLA, VANILLA, connector="NixlPushConnector", optional=True),
        _pd("staged-contiguous", "PD, kvcached_pd staged on kvcached's default (contiguous) "
            "layout", PD_STAGED_CONTIG, PD_STAGED_CONTIG),
        _pd("push-contiguous", "NixlPushConnector, kvcached_pd staged, contiguous layout",
            PD_STAGED_CONTIG, PD_STAGED_CONTIG, connector="NixlPushConnector", optional=True),
        _pd("staged-nixl", "PD, kvcached_pd staged, contiguous layout, KVCACHED_PD_WIRE=nixl "
            "(the NIXL READ even where CUDA IPC could serve)",
            PD_STAGED_CONTIG_NIXL, PD_STAGED_CONTIG_NIXL),
        _pd("push-nixl", "NixlPushConnector, kvcached_pd staged, contiguous layout, "
            "KVCACHED_PD_WIRE=nixl", PD_STAGED_CONTIG_NIXL, PD_STAGED_CONTIG_NIXL,
            connector="NixlPushConnector", optional=True),
        _pd("blocksize", "kvcached_pd staged, P --block-size 16, D --block-size 32",
            PD_STAGED, InstanceConfig("kvcached-pd-staged-bs32", kvcached_pd_env("staged"), 32)),
        _pd("negative", "negative control: kvcached_pd staged + KVCACHED_PD_TEST_CORRUPT=1 "
            "(must come out DIFFERENT)",
            InstanceConfig("kvcached-pd-staged-corrupt", kvcached_pd_env("staged", corrupt=True)),
            InstanceConfig("kvcached-pd-staged-corrupt", kvcached_pd_env("staged", corrupt=True)),
            expect_different=True, clean_twin="kvcached-pd-staged"),
        _pd("kvcached-pd-staged-nospin", "PD, staged, KVCACHED_PD_READ_SPIN_US=0",
            PD_STAGED_NOSPIN, PD_STAGED_NOSPIN, tags=(BENCH_ONLY,)),
        _pd("kvcached-pd-staged-prealloc",
            "PD, staged, kvcached keeps 64-96 pages mapped ahead on both sides",
            PD_STAGED_PREALLOC, PD_STAGED_PREALLOC, tags=(BENCH_ONLY,)),
    ]
}

# The modes the transfer benchmark compares side by side, in the order it measures them:
# the slowest (kvcached's own patch, ~0.5 GB/s) last, so a tight deadline cuts it first.
# At most three kvcached modes: all pairs start at once, and on the 2xH200 host ten
# kvcached instances starting together ran kvcached out of device memory.
BENCH_MODES = ("vanilla", "kvcached-pd-staged", "kvcached-pd-staged-prealloc", "kvcached-own")

WIRE_ENV = "KVCACHED_PD_WIRE"
WIRES = ("nixl", "ipc")


def staged_pair(mode: Mode) -> bool:
    """Both sides run kvcached-pd's staged transport: only then does D pick a wire for its
    peer (a vanilla side has no staging to read)."""
    return mode.is_pd and all(
        c.env.get("KVCACHED_PD") == "1" and c.env.get("KVCACHED_PD_TRANSPORT") == "staged"
        for c in (mode.prefill, mode.decode))


def expected_wire(mode: Mode, default: str | None) -> str | None:
    """The wire D must report for its peer in ``mode``: the one the mode forces on D
    (KVCACHED_PD_WIRE=nixl|ipc), else ``default`` (what the host should give kvcached-pd's
    automatic choice, e.g. ipc with P and D on one GPU; None: not checked). None for a
    mode that is not a staged pair."""
    if default is not None and default not in WIRES:
        raise ValueError(f"wire {default!r}: expected one of {WIRES}")
    if not staged_pair(mode):
        return None
    forced = mode.decode.env.get(WIRE_ENV, "auto")
    return forced if forced in WIRES else default


# ---- load flavours (pd_load.py) --------------------------------------------------------
# Under load kvcached-pd must hold up with kvcached exactly as an operator gets it:
# kvcached's own defaults plus its activation switches, with no page reserve
# (KVCACHED_MIN/MAX_RESERVED_PAGES), no KVCACHED_PD_STAGING_MB and, by default, no
# KVCACHED_CONTIGUOUS_LAYOUT (kvcached's default is the contiguous layout; measured on the
# 2 x H200 host: 8 x 3000-token TTFT 81-90 ms contiguous against 361-365 ms split).
# ``--kvcached-layout split`` sets KVCACHED_CONTIGUOUS_LAYOUT=false, what kvcached's own
# NIXL path and kvcached-pd's direct transport need.
KVCACHED_DEFAULTS = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}
KVCACHED_LAYOUTS = {"contiguous": {}, "split": {"KVCACHED_CONTIGUOUS_LAYOUT": "false"}}


def load_env(transport: str | None, layout: str = "contiguous",
             wire: str | None = None) -> dict[str, str]:
    """Environment of one load-flavour instance: vanilla (transport None) or kvcached with
    kvcached-pd's ``transport``, on kvcached's defaults and the chosen layout; ``wire``
    forces KVCACHED_PD_WIRE (None: kvcached-pd's default)."""
    if transport is None:
        return dict(KVCACHED_OFF)
    if layout not in KVCACHED_LAYOUTS:
        raise ValueError(f"kvcached layout {layout!r}: expected one of {sorted(KVCACHED_LAYOUTS)}")
    env = {**KVCACHED_DEFAULTS, **KVCACHED_LAYOUTS[layout], "KVCACHED_PD": "1",
           "KVCACHED_PD_TRANSPORT": transport}
    if wire is not None:
        env[WIRE_ENV] = wire
    return env


KVCACHED_SINGLE = "kvcached-single"  # the load flavour that is one kvcached instance
SINGLE = "single"  # its "transport": no PD at all

# vLLM's scheduling without its asynchronous pipeline (``--no-async-scheduling``). With it
# (vLLM's default) the engine schedules step N+1 while step N runs, so a request that
# reaches a busy engine waits for the step already queued behind the running one before
# its own: one more engine step on its way. A prefill instance's steps are its prompts'
# whole forwards (P step p50 14-19 ms tiny, 32-47 ms kvbig on one H200 shared with D,
# 2026-11-28c), and what the pipeline hides (the host's scheduling between steps, ~1 ms)
# is small beside them; a decode instance's steps are 3.5-4.5 ms, where it is not.
NO_ASYNC = ("--no-async-scheduling",)

# P and D on one GPU are two CUDA contexts the GPU takes turns with; under one MPS server
# their kernels share the SMs. CUDA_MPS_CLIENT_PRIORITY=1 (NVIDIA's MPS guide: 0 normal, 1
# below normal) makes P's work yield to D's when both wait for SMs; with
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE P's kernels never hold more than that share of them.
MPS_LOW_PRIORITY_P = (("CUDA_MPS_CLIENT_PRIORITY", "1"),)
MPS_SM60_P = (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "60"),)
# P's steps cut at 2048 prompt tokens (vLLM's default on these GPUs: 8192), so that no step
# of P's runs long beside D's
SHORT_STEPS_P = ("--max-num-batched-tokens", "2048")
# ... or twice vLLM's default: 2026-11-28g's traces (critical_path.py's passes line) found
# 62-79% of tiny's requests passed over by one or more of P's scheduling passes after their
# arrival, 29-55% of those passes with P's 8192 tokens all taken. The budget also sizes
# P's default staging (kvcached_pd/transport/sizing.py: max(2 x max_model_len, 2 x
# max_num_batched_tokens of KV, 2 GiB) within the KV budget): kvbig's P (256 KiB a token)
# then offers 8 GiB instead of 4, so a kvbig run measures both; tiny's P (32 KiB a token)
# stays at the 2 GiB floor
# Measured (2026-11-29, one H200, tiny, two runs): full passes 90-102 -> 21-37 a run, but
# P's arrival-to-admit unchanged (24-27 ms) and P's steps longer: e2e p50 1.04-1.05x of
# kvpd-push-p-sync's. Kept as a negative result; not advised
LONG_STEPS_P = ("--max-num-batched-tokens", "16384")
# Prefill steps in CUDA graphs: vLLM 0.30 captures graphs up to 512 tokens by default
# (its max_cudagraph_capture_size), so P's steps, whole prompts of up to 8192 tokens, ran
# without one in 91-98% of P's logged steps (2026-11-29d; one instance's too in 18-26% of
# its steps). With these sizes P's prefill steps may run as piecewise graphs (P's steps
# were 12.8-26.0 ms p50 there, its queue 26-35 ms: what P's step takes is what a request
# arriving at P waits). vLLM's default list up to 512, then every 512 tokens up to 8192
# (vLLM's default token budget on these GPUs); a step pads up to the next size. One
# instance gets the same sizes in its own flavour, so that the comparison stays even.
# Measured (2026-11-29e, six runs): every step of P PIECEWISE, P's steps 15-35% shorter,
# PD's e2e p50 median 1.35x -> 1.26x one instance, p90 1.33x -> 1.17x; but one instance
# with the same sizes 0.91x itself, so like for like PD stays at 1.42x (median).
PREFILL_GRAPH_SIZES = ([1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
                       + list(range(1024, 8193, 512)))
PREFILL_GRAPHS = ("--compilation-config",
                  '{"cudagraph_capture_sizes": [' +
                  ", ".join(str(n) for n in PREFILL_GRAPH_SIZES) + "]}")
# A PD pair on kvcached-pd's staged path holds four NIXL agents, vLLM's and kvcached-pd's
# in each of P and D, and each agent's UCX progress thread polls without pause: one CPU
# each for the process's life (2026-11-28f), on the IPC wire too, where kvcached-pd's
# agents carry only the DONEs. D's engine loop on vLLM 0.30.0 is host-bound on the tiny
# model (its decode steps alone 3.5-4.1 ms, 2.9-3.3 on 0.26.0, 2026-11-29/29d), so what
# four spinning CPUs beside it cost is what kvcached-single-spin4 measures: the one
# instance with four processes spinning a CPU each while it serves.
# Measured (2026-11-29e, one H200 of 16 cores, six runs): e2e p50 0.91-1.13x of the one
# instance alone (median 0.97x), p90 median 0.93x: not what keeps PD's loads above one
# instance there; the TTFT batch (one sample a run) 1.28x and 1.14x.
CPU_SPINNERS_OF_A_PD_PAIR = 4


@dataclass(frozen=True)
class LoadFlavour:
    description: str
    transport: str | None  # both sides' kvcached-pd transport; None: vanilla; SINGLE: no PD
    connector: str | None
    wire: str | None = None  # KVCACHED_PD_WIRE on both sides (None: kvcached-pd's default)
    prefill_args: tuple[str, ...] = ()  # vLLM serve flags of P alone (or of the one instance)
    decode_args: tuple[str, ...] = ()  # of D alone
    # P's own environment on top of the mode's (MPS client settings: CUDA reads them when
    # P's CUDA context connects to an MPS server and ignores them without one, so a flavour
    # that sets them names MPS in needs_mps and the load harness refuses it without a server)
    prefill_env: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # both sides' environment on top of the mode's
    # processes that each spin one CPU while this mode is measured (pd_load.py), as many as
    # the busy-polling NIXL progress threads a PD pair brings (CPU_SPINNERS_OF_A_PD_PAIR)
    cpu_spinners: int = 0

    @property
    def needs_mps(self) -> bool:
        return any(k.startswith("CUDA_MPS_") for k, _ in self.prefill_env)


LOAD_FLAVOURS: dict[str, LoadFlavour] = {
    "vanilla": LoadFlavour("PD, vLLM without kvcached", None, "NixlConnector"),
    "kvpd-staged": LoadFlavour("PD, kvcached + kvcached-pd staged pull", "staged",
                               "NixlConnector"),
    "kvpd-push": LoadFlavour("PD, kvcached + kvcached-pd staged push", "staged",
                             "NixlPushConnector"),
    "kvpd-direct": LoadFlavour("PD, kvcached + kvcached-pd direct (needs --kvcached-layout "
                               "split)", "direct", "NixlConnector"),
    "vanilla-push": LoadFlavour("PD, vLLM's own push without kvcached", None,
                                "NixlPushConnector"),
    "kvpd-staged-nixl": LoadFlavour("PD, kvcached + kvcached-pd staged pull, "
                                    "KVCACHED_PD_WIRE=nixl", "staged", "NixlConnector", "nixl"),
    "kvpd-push-nixl": LoadFlavour("PD, kvcached + kvcached-pd staged push, "
                                  "KVCACHED_PD_WIRE=nixl", "staged", "NixlPushConnector", "nixl"),
    # P scheduling without vLLM's asynchronous pipeline (NO_ASYNC), D as vLLM defaults it;
    # "-sync": both sides without it
    "vanilla-p-sync": LoadFlavour("PD, vLLM without kvcached, P --no-async-scheduling", None,
                                  "NixlConnector", prefill_args=NO_ASYNC),
    "kvpd-staged-p-sync": LoadFlavour("PD, kvcached-pd staged pull, P --no-async-scheduling",
                                      "staged", "NixlConnector", prefill_args=NO_ASYNC),
    "kvpd-push-p-sync": LoadFlavour("PD, kvcached-pd staged push, P --no-async-scheduling",
                                    "staged", "NixlPushConnector", prefill_args=NO_ASYNC),
    "kvpd-push-sync": LoadFlavour("PD, kvcached-pd staged push, P and D "
                                  "--no-async-scheduling", "staged", "NixlPushConnector",
                                  prefill_args=NO_ASYNC, decode_args=NO_ASYNC),
    # P shares the GPU with D under MPS, P an MPS client below D (MPS_LOW_PRIORITY_P) or
    # held to part of the GPU's SMs (MPS_SM60_P), or with shorter steps
    # (SHORT_STEPS_P): three ways to keep P's prefill from stretching D's decode steps
    # beside it (1.1-1.7x one alone, 42-74% of D's steps, 2026-11-28e)
    "kvpd-push-p-sync-lowprio": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling and an MPS client of "
        "below-normal priority", "staged", "NixlPushConnector", prefill_args=NO_ASYNC,
        prefill_env=MPS_LOW_PRIORITY_P),
    "kvpd-push-p-sync-sm60": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling and an MPS client held to 60% "
        "of the GPU's SMs", "staged", "NixlPushConnector", prefill_args=NO_ASYNC,
        prefill_env=MPS_SM60_P),
    "kvpd-push-p-sync-mbt2k": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling --max-num-batched-tokens 2048",
        "staged", "NixlPushConnector", prefill_args=NO_ASYNC + SHORT_STEPS_P),
    "kvpd-push-p-sync-mbt16k": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling --max-num-batched-tokens 16384",
        "staged", "NixlPushConnector", prefill_args=NO_ASYNC + LONG_STEPS_P),
    # P's prefill steps as CUDA graphs up to 8192 tokens (PREFILL_GRAPHS), and one
    # instance likewise (2026-11-29e: both faster, one instance more)
    "kvpd-push-p-sync-pgraphs": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling and CUDA graphs up to 8192 "
        "tokens", "staged", "NixlPushConnector", prefill_args=NO_ASYNC + PREFILL_GRAPHS),
    # The two P-side changes that each shortened PD's loads, together: P's prefill steps as
    # CUDA graphs (pgraphs: e2e p50 median 1.35x -> 1.26x one instance, 2026-11-29e) and P
    # an MPS client held to 60% of the SMs (sm60: kvbig e2e p50 1.07-1.14x, against push
    # P-sync's 1.10-1.19x under the same MPS server, 2026-11-28f); MPS as for sm60.
    # Measured (2026-11-29f, eight runs under MPS): no gain over pgraphs alone (e2e p50
    # medians tiny 1.35x against 1.30x, kvbig 1.10x against 1.05x; TTFT batch 1.25x
    # against 1.11x): not advised
    "kvpd-push-p-sync-pgraphs-sm60": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling, CUDA graphs up to 8192 "
        "tokens and an MPS client held to 60% of the GPU's SMs", "staged",
        "NixlPushConnector", prefill_args=NO_ASYNC + PREFILL_GRAPHS, prefill_env=MPS_SM60_P),
    # kvcached-pd's prompt_tail_graph patch left out on both sides (KVCACHED_PD_DISABLE):
    # on vLLM 0.30 (Model Runner V2) D's step running a loaded request's first forward
    # then leaves the FULL decode CUDA graph, as vLLM has it; the A/B of that patch
    "kvpd-push-p-sync-no-tail-graph": LoadFlavour(
        "PD, kvcached-pd staged push, P --no-async-scheduling, without kvcached-pd's "
        "prompt_tail_graph patch", "staged", "NixlPushConnector", prefill_args=NO_ASYNC,
        env=(("KVCACHED_PD_DISABLE", "prompt_tail_graph"),)),
    "vanilla-p-sync-lowprio": LoadFlavour(
        "PD, vLLM without kvcached, P --no-async-scheduling and an MPS client of "
        "below-normal priority", None, "NixlConnector", prefill_args=NO_ASYNC,
        prefill_env=MPS_LOW_PRIORITY_P),
    # Not PD: one kvcached instance (kvcached's own patches, kvcached-pd off) serving the
    # load like the reference. Beside the vanilla reference it splits a PD mode's gap to
    # one instance into kvcached's own cost (pages mapped as KV grows) and kvcached-pd's.
    KVCACHED_SINGLE: LoadFlavour("one instance, no PD, kvcached on (its defaults), "
                                 "kvcached-pd off", SINGLE, None),
    "kvcached-single-graphs": LoadFlavour("one instance as kvcached-single, CUDA graphs "
                                          "up to 8192 tokens", SINGLE, None,
                                          prefill_args=PREFILL_GRAPHS),
    "kvcached-single-spin4": LoadFlavour(
        "one instance as kvcached-single, four processes spinning a CPU each beside it (a "
        "PD pair's NIXL progress threads)", SINGLE, None,
        cpu_spinners=CPU_SPINNERS_OF_A_PD_PAIR),
    "kvcached-single-sync": LoadFlavour("one instance as kvcached-single, "
                                        "--no-async-scheduling", SINGLE, None,
                                        prefill_args=NO_ASYNC),
}
LOAD_DEFAULT_MODES = ("vanilla", "kvpd-staged", "kvpd-push")


def load_modes(names: list[str], layout: str = "contiguous") -> list[Mode]:
    """The no-PD reference first, then the named load flavours in the order given."""
    out = [Mode("reference", "one vanilla instance, no PD: the ground truth", single=VANILLA)]
    for name in names:
        if name not in LOAD_FLAVOURS:
            raise SystemExit(f"unknown load mode {name!r}; known: {', '.join(LOAD_FLAVOURS)}")
        if any(m.name == name for m in out):
            continue
        f = LOAD_FLAVOURS[name]
        if f.transport == SINGLE:
            env = {**KVCACHED_DEFAULTS, **KVCACHED_LAYOUTS[layout], "KVCACHED_PD": "0"}
            out.append(Mode(name, f.description, single=InstanceConfig(
                f"kvcached-{layout}", env, serve_args=f.prefill_args)))
            continue
        flavour = "vanilla" if f.transport is None else \
            f"kvcached-pd-{f.transport}-{layout}" + (f"-{f.wire}" if f.wire else "")
        env = {**load_env(f.transport, layout, f.wire), **dict(f.env)}
        out.append(_pd(name, f.description,
                       InstanceConfig(flavour, {**env, **dict(f.prefill_env)},
                                      serve_args=f.prefill_args),
                       InstanceConfig(flavour, env, serve_args=f.decode_args),
                       connector=f.connector))
    return out


def resolve_modes(names: list[str]) -> list[Mode]:
    """Expand 'all' (every mode but the bench-only ones), check names, keep the order
    given (deduplicated)."""
    every = [n for n, m in MODES.items() if BENCH_ONLY not in m.tags]
    out: list[Mode] = []
    for name in names:
        for n in (every if name == "all" else [name]):
            if n not in MODES:
                raise SystemExit(f"unknown mode {n!r}; known: {', '.join(MODES)} or 'all'")
            if MODES[n] not in out:
                out.append(MODES[n])
    return out


def kv_transfer_config(connector: str, role: str, engine_id: str) -> dict:
    """The --kv-transfer-config of one PD instance.

    kv_load_failure_policy=fail (vLLM 0.26 KVTransferConfig field): a KV load that fails
    must fail the request rather than be silently recomputed, or a broken transfer
    could still produce the right text. engine_id is explicit so logs and push-mode
    coordinates are readable and stable.
    """
    return {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "fail",
    }
