"""The workers' registries hold exactly the names configs are checked against (``workers.names``)."""

import pytest

from workers import models, names
from workers.engines import ENGINES
from workers.tasks import LOSSES


def test_each_registry_registers_exactly_the_names_a_config_may_give():
    assert tuple(sorted(models._FACTORIES)) == names.MODEL_NAMES
    assert tuple(ENGINES) == names.ENGINE_NAMES
    assert tuple(LOSSES) == names.LOSS_NAMES
    assert set(names.TASK_OF_LOSS) == set(names.LOSS_NAMES)


def test_a_built_in_model_missing_from_the_names_is_refused_at_registration():
    with pytest.raises(ValueError, match="must be listed in workers.names.MODEL_NAMES"):
        models._register("unlisted_model")
