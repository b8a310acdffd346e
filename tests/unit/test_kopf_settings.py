"""The operator keeps no diff base (handlers.EventsOnly): that is right only while every handler
is an on.event one; a change-detecting handler added later would never see a change."""
import kopf

from pd_operator import handlers


def test_every_handler_is_an_event_handler_so_no_diff_base_is_needed():
    registry = kopf.get_default_registry()
    assert registry._watching.get_all_handlers(), "the event handlers are registered"
    assert not registry._changing.get_all_handlers(), \
        "a change handler needs Kopf's diff base: drop handlers.EventsOnly"
    assert not registry._spawning.get_all_handlers()


def test_the_diff_base_is_empty_and_never_stored():
    body = kopf.Body({"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {"n": 1}})
    store = handlers.EventsOnly()
    assert store.build(body=body) == {} and store.fetch(body=body) is None
