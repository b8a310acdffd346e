"""The load report's window (pd_agent.loadmeter): what arrived, what was computed, the steps."""
from pd_agent.loadmeter import STEPS_KEPT, LoadMeter
from pd_contract.agent_api import Load


def test_the_window_counts_what_happened_in_it_and_forgets_the_rest():
    m = LoadMeter(window_s=10)
    m.arrived(1000, at=1.0)          # falls out of the window
    m.arrived(3000, at=5.0)
    m.arrived(500, at=9.0)
    m.prefilled(3500, 0.4, at=9.5)
    for i in range(STEPS_KEPT + 8):
        m.step(4, 4 * 700, 24.0, at=10.0 + i * 0.024)
    m.completed(at=10.5)
    m.context_tokens = 2800
    load = m.fill(Load(max_batch=4), at=12.0)
    assert (load.window_s, load.requests_arrived, load.prompt_tokens_arrived) == (10, 2, 3500)
    assert (load.prefill_tokens, load.prefill_busy_s) == (3500, 0.4)
    assert load.output_tokens == 4 * (STEPS_KEPT + 8) and load.decodes_completed == 1
    assert len(load.steps) == STEPS_KEPT and load.steps[-1].batch == 4 and load.context_tokens == 2800
    assert load.max_batch == 4, "what the serving reported is kept"
    later = m.fill(Load(), at=30.0)
    assert (later.requests_arrived, later.prefill_tokens, later.output_tokens, later.decodes_completed) == (0, 0, 0, 0)


def test_a_role_switch_starts_an_empty_window_as_long_as_it_is():
    m = LoadMeter(window_s=10)
    for i in range(8):
        m.arrived(200, at=1.0 + i)    # decodes taken on as a decoder
    m.step(4, 2800, 24.0, at=8.5)
    m.completed(at=8.6)
    m.reset(at=9.0)                   # now a prefill
    just = m.fill(Load(), at=9.5)
    assert (just.requests_arrived, just.output_tokens, just.decodes_completed, just.steps) == (0, 0, 0, [])
    assert just.window_s == 2.0, "a rate over half a second is noise: at least MIN_WINDOW_S"
    m.arrived(3000, at=12.0)
    later = m.fill(Load(), at=14.0)
    assert (later.window_s, later.requests_arrived) == (5.0, 1)
    assert m.fill(Load(), at=30.0).window_s == 10


def test_what_it_took_on_in_the_role_it_left_stays_counted_until_it_ages_out():
    """The fleet's demand over the window: the prompts an engine took on before it left the prefill
    role, and the decodes it finished before it left the decoder role, are still reported (as
    earlier_*), apart from the new role's own window, until they are older than the window."""
    m = LoadMeter(window_s=10)
    for i in range(6):
        m.arrived(1000, at=2.0 + i)       # prompts taken on as a prefill
    m.reset(at=8.0, left="prefill")       # now a decoder
    m.arrived(1000, at=9.0)               # a decode taken on
    m.step(2, 2400, 20.0, at=9.5)
    m.completed(at=9.6)
    now = m.fill(Load(), at=10.0)
    assert (now.window_s, now.requests_arrived, now.decodes_completed) == (2.0, 1, 1)
    assert (now.full_window_s, now.earlier_prompts_arrived, now.earlier_prompt_tokens_arrived) == (10, 6, 6000)
    assert (now.earlier_output_tokens, now.earlier_decodes_completed) == (0, 0)
    m.reset(at=11.0, left="decoder")      # a prefill again: the decode it finished stays counted too
    back = m.fill(Load(), at=12.0)
    assert (back.requests_arrived, back.earlier_prompts_arrived) == (0, 6)
    assert (back.earlier_output_tokens, back.earlier_decodes_completed) == (2, 1)
    aged = m.fill(Load(), at=14.5)        # the prompts of 2.0-4.0 s are out of the window
    assert aged.earlier_prompts_arrived == 3
    assert m.fill(Load(), at=30.0).earlier_prompts_arrived == 0
    m.arrived(500, at=31.0)
    m.reset(at=32.0)                      # a reset that does not say the role drops what it saw
    assert m.fill(Load(), at=33.0).earlier_prompts_arrived == 0


def test_an_engine_that_just_started_counts_over_as_long_as_it_has_run():
    """Five seconds of arrivals over a whole ten-second window would be half the rate: the first
    windows, the role's and the fleet's, are as long as the engine has run."""
    m = LoadMeter(window_s=10, started=100.0)
    for i in range(50):
        m.arrived(300, at=100.0 + i * 0.1)
    first = m.fill(Load(), at=105.0)
    assert (first.window_s, first.full_window_s, first.requests_arrived) == (5.0, 5.0, 50)
    assert LoadMeter(window_s=10, started=100.0).fill(Load(), at=100.5).full_window_s == 2.0, \
        "at least MIN_WINDOW_S"
    m.reset(at=108.0, left="prefill")
    switched = m.fill(Load(), at=112.0)
    assert (switched.window_s, switched.full_window_s, switched.earlier_prompts_arrived) == (4.0, 10, 30)
    early = LoadMeter(window_s=10, started=100.0)
    early.reset(at=97.0)              # a switch timed before the start counts from the start
    assert early.fill(Load(), at=104.0).window_s == early.fill(Load(), at=104.0).full_window_s == 4.0
