"""Status codes become reasons and messages an engineer can act on."""
from pd_operator.diagnosis import link_failure, proxy_warning, verify_failure


def test_link_failures():
    d = link_failure("LLM_TIMEOUT", "dec-0", "pre-1", "10.0.0.2", 26000, 500)
    assert d.reason == "LinkTimeout" and "linkTimeoutMs" in d.message and "500 ms" in d.message
    d = link_failure("LLM_LINK_FAILED", "dec-0", "pre-1", "10.0.0.2", 26000, 500)
    assert d.reason == "EndpointUnreachable" and "pre-1 (10.0.0.2:26000)" in d.message and "NetworkPolicy" in d.message
    assert link_failure("LLM_CLUSTER_NUM_EXCEED_LIMIT", "d", "p", "", 1, 1).reason == "LinkLimit"
    assert link_failure("LLM_UNKNOWN_ERROR", "d", "p", "", 1, 1).reason == "LinkFailed"


def test_verify_failures():
    d = verify_failure("LLM_KV_CACHE_NOT_EXIST", "dec-0", "pre-1", "", model_id=7)
    assert d.reason == "CacheKeyMismatch" and "model_id" in d.message and "modelId=7" in d.message
    assert verify_failure("LLM_PARAM_INVALID", "d", "p", "", 0).reason == "CacheDescMismatch"
    assert verify_failure("LLM_WAIT_PROCESS_TIMEOUT", "d", "p", "", 0).reason == "PullTimeout"


def test_proxy_warning_names_pods_and_vars():
    d = proxy_warning({"dec-1": {"https_proxy": "x"}, "dec-0": {"http_proxy": "y", "no_proxy": "z"}})
    assert d.reason == "ProxyEnvironment"
    assert d.message.index("dec-0: http_proxy, no_proxy") < d.message.index("dec-1: https_proxy")
