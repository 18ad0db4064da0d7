"""fused_logprob: log-probs from the hidden states in chunks (probe/modeling/logprob.py), as verl's
fused kernels compute them: the same numbers and gradients as the whole logits, a chunk's
logits at a time, measured and traced, and exported as verl's key (refused elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from autotune.config import FUSED_CHUNK_TOKENS, ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES, estimate_memory
from autotune.memory.shape import model_shape
from autotune.probe.modeling.logprob import fused_head, fused_log_probs
from autotune.probe.modeling.models import build_model, load_model_config
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.render import dotted_get, render
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

MiB = 1 << 20


def unfused(hidden, weight, labels):
    return (hidden @ weight.T).float().log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)


@pytest.mark.parametrize("tokens, chunk", [(37, 5), (40, 8), (3, 512), (1, 1)])
def test_fused_log_probs_and_gradients_equal_the_whole_logits(tokens, chunk):
    """Every chunk boundary (37 tokens in chunks of 5 ends on a short chunk; 40 in 8 on a
    full one): a token left out, counted twice or shifted across a boundary fails here."""
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)
    expected = unfused(hidden, weight, labels)
    (expected * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got, _ = fused_log_probs(hidden, weight, labels, chunk_tokens=chunk)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, grads[1], rtol=1e-5, atol=1e-5)


def test_the_fused_head_gives_a_models_log_probs_without_its_logits():
    """Through a real (tiny) Qwen2: the head swapped in for one forward returns every
    position's log-prob of the next token, equal to the log-softmax of the model's logits,
    and the model's own head is back afterwards."""
    config = load_model_config("tiny-qwen2.5")
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 1000, (2, 24))
    labels = torch.roll(ids, -1, dims=1)
    logits = model(input_ids=ids, use_cache=False).logits
    expected = logits.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    head = model.get_output_embeddings()
    with fused_head(model, labels, chunk_tokens=7):
        got = model(input_ids=ids, use_cache=False).logits
    assert got.shape == (2, 24) and model.get_output_embeddings() is head
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def run_json(*args):
    done = subprocess.run([sys.executable, "-m", "autotune", *args, "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_fused_logprob_cuts_the_logits_measured_and_traced(make_request):
    """Real CPU probes with the knob off and on: the experience and update peaks fall by
    about what memory.py says the logits took (within 10%), and the trace follows the probe
    within 5% in every phase both ways. One micro-batch of 8 responses per phase, one step.
    The trace's error is -1.4% to -2.0% here, quiet or beside one busy process per core
    (benchmarks/trace_under_load.py); an outside run on a machine under load 6 to 12 measured
    a peak that put it at +3.3%: the trace's accuracy is the benchmark's (trace_accuracy.py),
    this test holds that the trace follows the probe."""
    from autotune.probe.trace import trace_request
    from autotune.runners.local import SubprocessRunner

    shape = model_shape("tiny-qwen2.5")
    peaks, traced, modelled = {}, {}, {}
    for fused in (False, True):
        request = make_request(rollout_batch_size=2, rollout_n=4, global_batch_size=2,
                               max_prompt_length=256,
                               max_response_length=128, micro_batch_size_update=4,
                               micro_batch_size_experience=8, fused_logprob=fused,
                               cpu_threads=None, warmup_steps=1)
        measured = SubprocessRunner().run(request)
        assert measured.ok, measured.message
        peaks[fused] = measured.phase_peak_mem_bytes
        traced[fused] = trace_request(request, TRACE_CPU_CONTEXT_BYTES).phase_peak_mem_bytes
        modelled[fused] = estimate_memory(shape, request.config, on_gpu=False).phases
    for fused in (False, True):
        for phase, measured_bytes in peaks[fused].items():
            assert abs(traced[fused][phase] / measured_bytes - 1) < 0.05, (fused, phase)
    saved, said = {}, {}
    for phase in ("experience", "update"):
        saved[phase] = peaks[False][phase] - peaks[True][phase]
        said[phase] = modelled[False][phase].parts["logits"] - \
            modelled[True][phase].parts["logits"]
    # the experience phase's peak is its logits: the saving is memory.py's to 10%. The
    # update's term is the whole logits' path at its largest as a GPU's kernels make it (the
    # trace's moments: logits.unfused_backward_bytes); the CPU's own kernels hold a little
    # more beside it (47 MiB saved here against 32 MiB said; the term before, which added
    # the kept log-softmax to the forward's logits, said 64)
    assert saved["experience"] > 100 * MiB, saved
    assert abs(saved["experience"] / said["experience"] - 1) < 0.10, (saved, said)
    assert 0.75 * said["update"] < saved["update"] < 1.6 * said["update"], (saved, said)
    assert abs(peaks[True]["rollout"] - peaks[False]["rollout"]) < 16 * MiB  # no logits there


def test_the_memory_model_holds_one_chunk_of_logits_when_fused():
    """qwen2.5-7b with 4k responses, micro-batch 8: unfused the experience phase holds the
    micro-batch's whole logits (37 GiB), fused one 512-token chunk's (0.6 GiB)."""
    shape = model_shape("qwen2.5-7b")
    base = {"max_prompt_length": 1024, "max_response_length": 4096, "rollout_batch_size": 64,
            "global_batch_size": 64, "rollout_n": 8, "micro_batch_size_experience": 8,
            "micro_batch_size_update": 8}
    off = estimate_memory(shape, ProbeConfig(**base), num_gpus=8, on_gpu=True,
                          engine_capacity_bytes=80 << 30).phases
    on = estimate_memory(shape, ProbeConfig(**base, fused_logprob=True), num_gpus=8,
                         on_gpu=True, engine_capacity_bytes=80 << 30).phases
    vocab, seq = shape.vocab, 1024 + 4096
    # bf16 logits of the whole sequence and the fp32 response log-softmax, or on a GPU the
    # fp32 slice and its log-softmax once the bf16 logits are freed, whichever is larger
    assert off["experience"].parts["logits"] == 8 * max(2 * seq + 4 * 4096, 8 * 4096) * vocab
    assert on["experience"].parts["logits"] == FUSED_CHUNK_TOKENS * vocab * 8
    assert on["update"].parts["logits"] == FUSED_CHUNK_TOKENS * vocab * 10
    assert off["experience"].total_bytes - on["experience"].total_bytes > 32 << 30
    # `estimate` states the saving per phase for the config as given (knob off)
    report = run_json("estimate", "--model", "qwen2.5-7b", "--gpus-per-node", "8",
                      "--capacity", "80GiB",
                      *(arg for knob, value in base.items()
                        for arg in ("--set", f"{knob}={value}")))
    # without an entropy the entropy switches change nothing and are not listed
    assert set(report["switch_savings"]) == {"fused_logprob"}
    saved = report["switch_savings"]["fused_logprob"]
    assert saved == {phase: off[phase].total_bytes - on[phase].total_bytes for phase in off
                     if off[phase].total_bytes != on[phase].total_bytes}
    # the rollout too, by a few MiB: the first update's logits segments it finds held
    # (memory.CARRIED_KNOBS)
    assert saved["experience"] > 32 << 30 and saved["update"] > 0
    assert abs(saved.get("rollout", 0)) < 64 << 20


def test_estimate_states_what_the_entropy_switches_save_or_add_where_an_entropy_is_taken():
    """qwen2.5-7b, 4k responses, micro-batches of 8: without an entropy the entropy switches
    change nothing and are not listed; with verl's metric and a bonus, chunking saves in
    experience what it adds in the update (chunks kept for the backward), as memory.py has
    it, and the text says both. (The config without an entropy is the fused-log-prob test's
    `estimate` above, which holds that no entropy switch is listed for it. One answer, taken
    in this process, gives the JSON and the text `estimate` prints: the CLI echoes one or
    the other of the same object; about 7 s of split search a computation.)"""
    from autotune import ProbeOptions, estimate
    from autotune.config import parse_assignments

    sets = [f"{knob}={value}" for knob, value in {
        "max_prompt_length": 1024, "max_response_length": 4096, "rollout_batch_size": 64,
        "global_batch_size": 64, "rollout_n": 8, "micro_batch_size_experience": 8,
        "micro_batch_size_update": 8, "entropy_metric": "true", "entropy_coeff": 0.01}.items()]
    answer = estimate(ProbeOptions(model="qwen2.5-7b", gpus_per_node=8,
                                   knobs=parse_assignments(sets)), capacity_bytes=80 << 30)
    saved = answer.as_dict()["switch_savings"]["entropy_chunking"]
    assert saved["experience"] > 10 << 30 and saved["update"] < -(10 << 30), saved
    text = answer.text()
    assert "entropy_chunking=true would save" in text and "add " in text, text


KNOBS = {"rollout_batch_size": 64, "rollout_n": 8, "global_batch_size": 32,
         "micro_batch_size_update": 4, "micro_batch_size_experience": 8,
         "gradient_checkpointing": True, "offload_params": False, "offload_optimizer": False,
         "max_prompt_length": 1024, "max_response_length": 1024, "val_batch_size": None}


def test_verl_writes_its_fused_kernels_key_and_the_others_refuse():
    topology = Topology(1, 8)
    text = render(VERL, {**KNOBS, "fused_logprob": True}, topology, None, ["p"],
                  searched=["fused_logprob"])
    tree = yaml.safe_load(text)
    assert tree["actor_rollout_ref"]["model"]["use_fused_kernels"] is True
    read = VERL.read_knobs(lambda key, default: dotted_get(tree, key, default), topology)
    assert read["fused_logprob"] is True
    for adapter, why in ((EASYR1, "EasyR1 has no fused log-prob kernel"),
                         (TRL, "verl's kernel, which TRL does not have")):
        with pytest.raises(ConfigError) as err:
            render(adapter, {**KNOBS, "fused_logprob": True}, topology, None, ["p"],
                   searched=["fused_logprob"])
        assert any(why in problem for problem in err.value.problems), err.value.problems
        render(adapter, {**KNOBS, "fused_logprob": False}, topology, None, ["p"],
               searched=["fused_logprob"])  # off: EasyR1's way; TRL's header states it
    # TRL's own head: exported with no key (TRL always scores through it)
    text = render(TRL, {**KNOBS, "fused_logprob": True, "fused_logprob_kernel": "trl"},
                  topology, None, ["p"], searched=["fused_logprob"])
    assert "fused" not in yaml.safe_load(text)


def test_the_entropy_terms_follow_the_trace():
    """entropy_metric (the experience phase's entropy, verl's actor/entropy), entropy_chunking
    and entropy_coeff (the update's entropy with its gradient), each traced (in this process)
    against the memory model: every knob moves both by the same bytes (within 2 MiB). With
    4,096 response positions per experience micro-batch, chunks of 2,048 keep the entropy's
    temporaries under the logits' own peak: chunked, the phase does not move at all."""
    from autotune.hardware import Device
    from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
    from autotune.probe.measure.result import ProbeRequest
    from autotune.probe.trace import trace_request

    shape = model_shape("tiny-qwen2.5")
    base = {"max_prompt_length": 16, "max_response_length": 512, "rollout_batch_size": 4,
            "global_batch_size": 4, "rollout_n": 4, "micro_batch_size_update": 2,
            "micro_batch_size_experience": 8}

    def peaks(**knobs):
        config = ProbeConfig(**{**base, **knobs})
        request = ProbeRequest(model="tiny-qwen2.5", config=config, device=Device("cpu"))
        traced = trace_request(request, TRACE_CPU_CONTEXT_BYTES).phase_peak_mem_bytes
        modelled = estimate_memory(shape, config, on_gpu=False).phases
        return traced, {phase: estimate.total_bytes for phase, estimate in modelled.items()}

    plain, fused = peaks(), peaks(fused_logprob=True)
    for knobs, phase, against, moves in (
            ({"entropy_metric": True}, "experience", plain, True),
            ({"entropy_metric": True, "entropy_chunking": True}, "experience", plain, False),
            ({"entropy_coeff": 0.01}, "update", plain, True),
            ({"entropy_coeff": 0.01, "entropy_chunking": True}, "update", plain, True),
            ({"fused_logprob": True, "entropy_metric": True}, "experience", fused, True)):
        traced, modelled = peaks(**knobs)
        moved_trace = traced[phase] - against[0][phase]
        moved_model = modelled[phase] - against[1][phase]
        assert (moved_trace > 16 * MiB) == moves, (knobs, moved_trace)
        assert abs(moved_trace - moved_model) < 2 * MiB, (knobs, moved_trace, moved_model)


def test_verl_writes_the_entropy_keys_and_says_what_it_takes_that_the_study_did_not():
    topology = Topology(1, 8)
    knobs = {**KNOBS, "entropy_coeff": 0.001, "entropy_chunking": True,
             "entropy_checkpointing": True}
    tree = yaml.safe_load(render(VERL, knobs, topology, None, ["p"]))
    actor = tree["actor_rollout_ref"]["actor"]
    assert (actor["entropy_coeff"], actor["entropy_from_logits_with_chunking"],
            actor["entropy_checkpointing"]) == (0.001, True, True)
    read = VERL.read_knobs(lambda key, default: dotted_get(tree, key, default), topology)
    assert {k: read[k] for k in ("entropy_coeff", "entropy_chunking",
                                 "entropy_checkpointing")} == {
        "entropy_coeff": 0.001, "entropy_chunking": True, "entropy_checkpointing": True}
    header = render(VERL, KNOBS, topology, None, ["p"])
    assert "entropy: verl takes every response position's entropy" in header
    assert "entropy: verl" not in render(VERL, {**KNOBS, "entropy_metric": True}, topology,
                                         None, ["p"])
    for adapter in (EASYR1, TRL):  # no entropy bonus the probe's arithmetic stands for
        with pytest.raises(ConfigError) as err:
            render(adapter, {**KNOBS, "entropy_coeff": 0.01}, topology, None, ["p"])
        assert "entropy_coeff=0.01" in err.value.problems[0]


def test_the_triton_kernels_allocations_are_traced_and_modelled():
    """fused_logprob_kernel=triton (verl's Triton linear cross-entropy): a trace cannot run
    Triton, so it allocates what the kernel does (per-split partials, a band of the logits'
    gradient); the memory model has the same terms (each phase within 3% of the trace), and
    both hold less than the torch chunks in the phases that take log-probs."""
    from autotune.hardware import Device
    from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
    from autotune.probe.measure.result import ProbeRequest
    from autotune.probe.trace import trace_request

    shape = model_shape("tiny-qwen2.5")
    base = {"max_prompt_length": 16, "max_response_length": 512, "rollout_batch_size": 4,
            "global_batch_size": 4, "rollout_n": 4, "micro_batch_size_update": 2,
            "micro_batch_size_experience": 8, "fused_logprob": True, "entropy_metric": True}
    traced, modelled = {}, {}
    for kernel in ("torch", "triton"):
        config = ProbeConfig(**base, fused_logprob_kernel=kernel)
        request = ProbeRequest(model="tiny-qwen2.5", config=config, device=Device("cpu"))
        traced[kernel] = trace_request(request, TRACE_CPU_CONTEXT_BYTES).phase_peak_mem_bytes
        modelled[kernel] = {phase: estimate.total_bytes for phase, estimate in
                            estimate_memory(shape, config, on_gpu=False).phases.items()}
    for phase, peak in traced["triton"].items():
        assert abs(modelled["triton"][phase] / peak - 1) < 0.03, (phase, modelled, traced)
    for phase in ("experience", "update"):
        assert traced["triton"][phase] < traced["torch"][phase], (phase, traced)
        assert modelled["triton"][phase] < modelled["torch"][phase], (phase, modelled)


def test_the_triton_kernel_is_refused_in_one_line_where_it_cannot_run():
    """On a CPU tensor the probe's fused head says where the kernel runs and what to do; verl
    writes the backend it runs with, and reads it back."""
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    with pytest.raises(RuntimeError, match="runs on a CUDA device only.*fused_logprob_kernel"
                                           "=torch"):
        fused_log_probs(hidden, weight, torch.zeros(6, dtype=torch.long), kernel="triton")
    topology = Topology(1, 8)
    knobs = {**KNOBS, "fused_logprob": True, "fused_logprob_kernel": "triton"}
    tree = yaml.safe_load(render(VERL, knobs, topology, None, ["p"]))
    assert tree["actor_rollout_ref"]["model"]["fused_kernel_options"]["impl_backend"] == \
        "triton"
    read = VERL.read_knobs(lambda key, default: dotted_get(tree, key, default), topology)
    assert read["fused_logprob_kernel"] == "triton"


def test_a_verl_study_on_a_gpu_runs_verls_triton_kernel_where_it_is_installed(
        tmp_path, monkeypatch):
    """Found from the installed files (nothing imported): verl with its kernel module and
    Triton beside it; either one missing, the torch chunks."""
    from autotune.sweep.plan import trainer_knobs, verl_triton_installed

    kernel = tmp_path / "verl" / "utils" / "kernel"
    kernel.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not verl_triton_installed()  # no kernel module yet, and no Triton
    (kernel / "linear_cross_entropy.py").write_text("")
    assert not verl_triton_installed()  # no Triton
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("")
    assert verl_triton_installed()
    assert trainer_knobs("verl", True)["fused_logprob_kernel"] == "triton"
    assert "fused_logprob_kernel" not in trainer_knobs("verl", False)  # a CPU has no Triton
    assert "fused_logprob_kernel" not in trainer_knobs("easyr1", True)


@pytest.mark.parametrize("tokens, vocab", [(9, 50), (6, 32768 + 40)])
def test_trls_head_equals_trl_and_the_whole_logits(tokens, vocab):
    """fused_logprob_kernel=trl: the probe's own copy of TRL's arithmetic (used where TRL is
    not installed) and TRL's ChunkedLogProbFunction give the whole logits' log-probs, entropy
    and gradients; 32,808 columns cross TRL's 32,768-column chunk (a column left out or
    counted twice fails here)."""
    from autotune.probe.modeling.logprob import TrlChunkedLogProb, trl_chunked_function

    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 16, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream, up_entropy = (torch.randn(tokens, generator=generator),
                            torch.randn(tokens, generator=generator))
    logits = (hidden @ weight.T).float()
    expected = logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    ((expected * upstream).sum() + (entropy * up_entropy).sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    trl = trl_chunked_function()
    assert trl is not None, "trl is a test dependency"
    runs = {"ours": lambda: TrlChunkedLogProb.apply(hidden, weight, labels, False),
            "trl's": lambda: trl.apply(hidden, weight, None, labels, 1.0, 32768, None, 1.0,
                                       ("log_probs", "entropy"))[:2]}
    # the hidden states' gradients sum over every column: fp32's rounding in another order
    # than autograd's moves them by up to 5e-4 of values near 8 (seeds 0-7)
    scale = grads[0].abs().max().item()
    seen = {}
    for name, run in runs.items():
        hidden.grad = weight.grad = None
        got, got_entropy = run()
        ((got * upstream).sum() + (got_entropy * up_entropy).sum()).backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4, msg=name)
        torch.testing.assert_close(got_entropy, entropy, rtol=0, atol=1e-4, msg=name)
        torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-4, atol=1e-4 * scale, msg=name)
        torch.testing.assert_close(weight.grad, grads[1], rtol=1e-4, atol=1e-4, msg=name)
        seen[name] = hidden.grad.clone(), weight.grad.clone()
    for ours, theirs in zip(seen["ours"], seen["trl's"], strict=True):  # the same arithmetic
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_trls_head_measured_traced_and_modelled(make_request):
    """TRL's step on the CPU (its fused head over every position, generation by the policy,
    no reference, no old-log-prob pass): the real probe's peaks and the trace's (which runs
    the probe's copy of TRL's arithmetic on fake tensors) within 3% in the update, the step's
    peak, and memory.py's logits term against what the head adds over verl's torch chunks
    there. The other phases' measured peaks also hold heap glibc kept from the step before
    (about 50 MiB after TRL's tiles): the trace is at most that."""
    from autotune.probe.trace import trace_request
    from autotune.runners.local import SubprocessRunner

    shape = model_shape("tiny-qwen2.5")
    peaks, traced, modelled = {}, {}, {}
    for kernel in ("torch", "trl"):
        request = make_request(rollout_batch_size=2, rollout_n=4, global_batch_size=2,
                               max_prompt_length=64, max_response_length=128,
                               micro_batch_size_update=8, micro_batch_size_experience=8,
                               fused_logprob=True, fused_logprob_kernel=kernel,
                               rollout_engine="policy", use_kl=False, old_logprob_pass=None,
                               cpu_threads=None, warmup_steps=1)
        measured = SubprocessRunner().run(request)
        assert measured.ok, measured.message
        peaks[kernel] = measured.phase_peak_mem_bytes
        traced[kernel] = trace_request(request, TRACE_CPU_CONTEXT_BYTES).phase_peak_mem_bytes
        modelled[kernel] = estimate_memory(shape, request.config, on_gpu=False).phases
    for kernel, phases in peaks.items():
        assert abs(traced[kernel]["update"] / phases["update"] - 1) < 0.03, kernel
        for phase, measured_bytes in phases.items():
            assert 0.8 < traced[kernel][phase] / measured_bytes < 1.03, (kernel, phase)
    added = peaks["trl"]["update"] - peaks["torch"]["update"]
    said = modelled["trl"]["update"].parts["logits"] - modelled["torch"]["update"].parts["logits"]
    assert added > 50 * MiB, added  # TRL's 32,768-column buffers and fp32 tiles
    assert 0.7 * said < added < 1.3 * said, (added, said)
