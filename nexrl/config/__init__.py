from nexrl.config.loader import ConfigError, load_config
from nexrl.config.schema import RLTrainConfig

__all__ = ["ConfigError", "RLTrainConfig", "load_config"]
