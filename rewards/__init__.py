"""Reward plugins for mmalign: the API (`rewards.base`) and the built-in rewards (`rewards.text`, ...).

``rewards.get(name)`` returns the registered reward class, ``rewards.names()`` lists the registered
names; ``load_reward(spec, **options)`` builds one from a name, an entry point of group
``mmalign.rewards`` or a ``package.module:Class`` path (``resolve(spec)``: what it names, nothing built);
``RewardSet`` evaluates a config's list, ``check_reward_specs`` checks one without building it.

The modules imported below register the built-in rewards; every other reward is found on lookup through
the entry points of group ``mmalign.rewards`` (one per name, naming the module that registers it): a
third-party package's, and this project's offline shapes-world rewards (``shapes_compositional``,
``shapes_layout``, ``shapes_edit_accuracy``, ``colour_present``), which live with their fixtures in
`mmalign.tiny.world_rewards` (a source checkout only; pyproject.toml declares their entry points), so that
this package never imports `mmalign.tiny`.
"""

from . import geneval as geneval  # registers geneval and geneval_local, GenEval's checks (rewards/geneval.py)
from . import geometry as geometry  # registers the latent geometry rewards (rewards/geometry.py)
from . import judge as judge  # registers openai_judge and editscore, judges over HTTP (rewards/judge.py)
from . import preference as preference  # registers hpsv2, image_reward, hpsv3 (rewards/preference.py)
from . import process as process  # registers sampler_process_reward (rewards/process.py)
from . import remote as remote  # registers remote, a reward served over HTTP (rewards/remote.py)
from . import seed_rewards as seed_rewards  # registers the seed papers' rewards (rewards/seed_rewards.py)
from . import video as video  # registers the video rewards (rewards/video.py)
from .base import (
    ENTRY_POINT_GROUP,
    REGISTRY,
    FunctionReward,
    Reward,
    RewardBatch,
    RewardError,
    RewardKeyError,
    RewardSet,
    RewardSpec,
    check_reward_specs,
    entry_point_names,
    get,
    load_reward,
    names,
    register_reward,
    resolve,
)
from .boxes import BoxCenter, BoxF1, BoxGIoU, IoUAt, IoUSweep
from .embedding import EmbeddingSimilarity  # embedding_similarity; its model loads on the first call
from .geometry import CameraSmoothness, MotionGuard, ReprojectionConsistency
from .image import (
    AestheticScore,
    ClipScore,
    JpegCompressibility,
    JpegIncompressibility,
    PreferenceScore,
)
from .multimodal import BMAS, BoxIoU, MixedAccuracy, MultipleChoice
from .ocr import OCRReward  # ocr; EasyOCR is imported on the first call
from .process import SamplerProcessReward
from .safety import ClassifierFlag, ClipConceptFlag, ClipSteering
from .search import CropKeepsTarget, SearchFormat, ToolUseBonus, TurnsUsed
from .text import AnswerAccuracy, FormatReward, OverlongPenalty

__all__ = [
    "AestheticScore",
    "CameraSmoothness",
    "MotionGuard",
    "ReprojectionConsistency",
    "SamplerProcessReward",
    "ClipScore",
    "JpegCompressibility",
    "JpegIncompressibility",
    "PreferenceScore",
    "ClassifierFlag",
    "ClipConceptFlag",
    "ClipSteering",
    "CropKeepsTarget",
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "BMAS",
    "AnswerAccuracy",
    "BoxCenter",
    "BoxF1",
    "BoxGIoU",
    "BoxIoU",
    "IoUAt",
    "IoUSweep",
    "EmbeddingSimilarity",
    "FormatReward",
    "FunctionReward",
    "MixedAccuracy",
    "MultipleChoice",
    "OCRReward",
    "OverlongPenalty",
    "SearchFormat",
    "ToolUseBonus",
    "TurnsUsed",
    "Reward",
    "RewardBatch",
    "RewardError",
    "RewardKeyError",
    "RewardSet",
    "RewardSpec",
    "check_reward_specs",
    "entry_point_names",
    "get",
    "load_reward",
    "names",
    "register_reward",
    "resolve",
]
