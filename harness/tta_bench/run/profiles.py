"""The TTA-VLM protocol option (``tta_vlm=true``): run a method as TTA-VLM (Sheng et al.,
NeurIPS 2025 Datasets and Benchmarks, TomSheng21/tta-vlm, read at commit
bcc735fe49cbd2ab5b683781c41c66e1d3f78589: instance_tta.py, online_tta.py,
data/datautils.py) runs it, so that rows can be set beside its tables.

What the option sets (each only where the run does not set it itself):

* the text head: the single prompt ``"a photo of a {}."`` for every method
  (``protocol.templates``; part of the protocol id);
* episodic methods (``Method.stream_kind == "episodic"``): reset per image, batch size 1
  (``protocol.reset=episodic_sample``); their views stay the method's (TTA-VLM: the
  original + 63);
* online methods (``stream_kind == "online"``): one stream per shift of batch size 1
  (``protocol.reset=reset_each_shift``, ``protocol.batch_size=1``), shuffled with the seed
  as every stream here is;
* AugMix views on the fine-grained sets only (TTA-VLM's ``augmix=len(set_id) > 1``): a
  method config with an ``augmix`` field gets ``augmix = fine_grained``, where a dataset's
  catalogue entry says ``fine_grained: true``; on a suite whose domains are several
  datasets per dataset (``RunSpec.method_configs``, recorded as
  ``method.augmix@<dataset>`` in ``tta_vlm_applied``);
* then the method's own ``Method.tta_vlm`` values: where TTA-VLM's implementation departs
  from the method's official code (a view count, a fusion weight, a single view), the
  official code stays the default and the option gives TTA-VLM's setting.

A method config value the run sets to something other than its default wins over the
option; a protocol field the run overrides (``protocol.batch_size=...``) wins too. Methods
with neither kind (the TENT family, the CLIP batch methods) keep the suite's stream and
get the single prompt only: TTA-VLM does not run them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: TTA-VLM's one prompt for every method and dataset.
PROMPT = "a photo of a {}."


def protocol_overrides(given: dict[str, Any], stream_kind: str | None) -> dict[str, Any]:
    """``given`` (the run's protocol overrides) completed with the option's settings."""
    out = dict(given)
    out.setdefault("templates", [PROMPT])
    if stream_kind == "episodic":
        out.setdefault("reset", "episodic_sample")
    elif stream_kind == "online":
        out.setdefault("reset", "reset_each_shift")
        out.setdefault("batch_size", 1)
    return out


def method_config(method_cls: Any, mcfg: Any, fine_grained: bool) -> tuple[Any, dict[str, Any]]:
    """``(the method config under the option, {field: value} it set)``: AugMix on
    fine-grained sets, then ``method_cls.tta_vlm``, each only where ``mcfg`` still holds the
    class default."""
    if not dataclasses.is_dataclass(mcfg):
        return mcfg, {}
    defaults = method_cls.Config()
    names = {f.name for f in dataclasses.fields(mcfg)}
    wanted: dict[str, Any] = {}
    if "augmix" in names:
        wanted["augmix"] = bool(fine_grained)
    wanted.update(getattr(method_cls, "tta_vlm", {}) or {})
    unknown = sorted(set(wanted) - names)
    if unknown:
        raise ValueError(f"{method_cls.__name__}.tta_vlm names fields its Config lacks: {unknown}")
    applied = {
        k: v
        for k, v in wanted.items()
        if getattr(mcfg, k) == getattr(defaults, k) and getattr(mcfg, k) != v
    }
    return dataclasses.replace(mcfg, **applied), applied
