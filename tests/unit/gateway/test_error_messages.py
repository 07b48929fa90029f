"""What a validation error says: a field the body's type does not have is named with its path."""

from __future__ import annotations

from fleet_gateway.errors import describe_problem


def test_an_unknown_top_level_field_is_named() -> None:
    message = describe_problem("data", "Object contains unknown field `model`")
    assert message == "the request body has a field this endpoint does not take: `model`"


def test_an_unknown_nested_field_is_named_with_its_path() -> None:
    message = describe_problem("data", "Object contains unknown field `colour` - at `$.webhook`")
    assert message == "the request body has a field this endpoint does not take: `webhook.colour`"


def test_other_problems_keep_their_field_and_message() -> None:
    assert describe_problem("text", "Expected `str`, got `int`") == "text: Expected `str`, got `int`"
