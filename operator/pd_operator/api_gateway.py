"""The PDGateway API (pdoperator.io/v1alpha1): one Base URL and one set of keys in front of
the PDDeployments of a namespace that its selector picks, each serving its model. Generated
into crds/pdgateway.yaml like the PDDeployment (``make crd``)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from .api import GROUP, VERSION, Condition, Model, Resources, map_list, rules  # noqa: F401

KIND = "PDGateway"
PLURAL = "pdgateways"
SINGULAR = "pdgateway"
SHORT_NAMES = ["pdgw"]
NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
KEY_NAME = r"^[-._a-zA-Z0-9]+$"   # a data key of the Secret


class KeyPolicy(Model):
    """What one API key (a data key of the keys Secret, by name) may do."""
    models: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        default=None, max_length=64, description="models (or aliases' models) it may use; default all")
    requests_per_minute: int | None = Field(default=None, ge=1, le=1_000_000)
    tokens_per_day: int | None = Field(default=None, ge=1, le=10**12,
                                       description="input plus output tokens per UTC day")
    expires: str | None = Field(default=None, max_length=64, json_schema_extra={"format": "date-time"},
                                description="RFC 3339; from then on the key is refused (401, saying it expired)")
    admin: bool = Field(default=False, description="may read every key's usage (GET /v1/usage)")


class Requirement(Model):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[Annotated[str, Field(max_length=63)]] | None = Field(default=None, max_length=64)


class Selector(Model):
    """A label selector over the namespace's PDDeployments; empty selects all."""
    match_labels: dict[str, Annotated[str, Field(max_length=63)]] | None = None
    match_expressions: list[Requirement] | None = Field(default=None, max_length=16)


class PDGatewaySpec(Model):
    model_config = ConfigDict(json_schema_extra=rules(
        (f"!has(self.keys) || self.keys.all(k, k.matches('{KEY_NAME}'))",
         "spec.keys: each name must be a data key of the keys Secret (letters, digits, '-', '_', '.')", ".keys"),
    ))
    api_keys_secret: str = Field(max_length=253, pattern=NAME,
                                 description="Secret with one data key per API key (its name -> the key); it must "
                                             "opt in with the label pdoperator.io/keys: \"true\"")
    selector: Selector | None = None
    replicas: int = Field(default=2, ge=1, le=64)
    keys: dict[str, KeyPolicy] | None = Field(
        default=None, max_length=1024, description="per key name; a key not listed may use every model, without quotas")
    resources: Resources | None = None


class ServedModel(Model):
    model: str
    deployment: str
    aliases: list[str] | None = None


class PDGatewayStatus(Model):
    phase: Literal["Pending", "Ready", "Degraded"] | None = None
    url: str | None = Field(default=None, description="the Service's address inside the cluster")
    models: list[ServedModel] | None = Field(default=None, json_schema_extra=map_list("model"))
    replicas: int | None = None
    ready_replicas: int | None = None
    conditions: list[Condition] | None = Field(default=None, json_schema_extra=map_list("type"))
    observed_generation: int | None = None


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

ROOT_RULES = rules(
    ("size(self.metadata.name) <= 50", "metadata.name must be at most 50 characters (object names derive from it)"),
)


def parse_spec(spec: dict) -> PDGatewaySpec:
    return PDGatewaySpec.model_validate(spec)
