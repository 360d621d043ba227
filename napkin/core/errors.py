"""The errors napkin raises on purpose.  Each message is one readable line."""


class NapkinError(ValueError):
    """Bad input: the message says which axis, size, rule or premise."""


class CompositionError(NapkinError):
    """Two diagrams do not compose: names both sides."""


class ShapeError(NapkinError):
    """Arrays handed to a diagram do not match its declared axes."""


class RuleError(NapkinError):
    """A rewrite rule does not apply; the message names the failed premise."""


class GraphError(NapkinError):
    """A diagram and its graph (napkin.core.ir) cannot be turned into one another:
    names the box or wire at fault."""
