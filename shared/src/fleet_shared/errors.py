"""Named exceptions shared by the gateway, the worker and the CLI."""


class FleetError(Exception):
    """Base class for fleet's own errors."""


class ConfigError(FleetError):
    """The configuration cannot be loaded; the message is one line naming the key or variable."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


class InvalidTransition(FleetError):
    """A Run command is not allowed from the Run's current status."""


class SkillCardError(ConfigError):
    """A skill card file cannot be used; the message names the file and the key."""


class SettingsConflict(FleetError):
    """The policy file changed since the client read it (its revision no longer matches)."""


class InvalidSettingChange(FleetError):
    """A settings change is refused; the message is one line naming the key. Nothing was written."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))
