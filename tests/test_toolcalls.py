from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout.toolcalls import (
    BadArgumentsError,
    MalformedToolCallError,
    NoToolCallError,
    ToolCall,
    ToolCallError,
    TooManyToolCallsError,
    UnknownToolError,
    parse_tool_calls,
    render_tool_call,
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "python",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
]


def test_hermes_as_qwen3_writes_it() -> None:
    text = (
        'I will list the files.\n<tool_call>\n{"name": "bash", "arguments": '
        '{"command": "ls -la /testbed"}}\n</tool_call>'
    )
    assert parse_tool_calls(text, tools=TOOLS) == [
        ToolCall(name="bash", arguments={"command": "ls -la /testbed"})
    ]


def test_hermes_survives_tags_and_braces_inside_strings() -> None:
    command = 'echo "</tool_call> {\\"a\\": }}" && printf "<tool_call>"'
    text = render_tool_call(ToolCall(name="bash", arguments={"command": command}))
    assert parse_tool_calls(text, tools=TOOLS)[0].arguments["command"] == command


def test_hermes_without_closing_tag_at_end_is_accepted() -> None:
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n'
    assert parse_tool_calls(text, tools=TOOLS)[0].arguments == {"code": "print(1)"}


def test_hermes_double_encoded_arguments() -> None:
    text = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x = 1\\"}"}</tool_call>'
    assert parse_tool_calls(text, tools=TOOLS)[0].arguments == {"code": "x = 1"}


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("I think the answer is 4.", NoToolCallError, "no <tool_call>"),
        (
            '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',
            MalformedToolCallError,
            "not valid JSON",
        ),
        (
            '<tool_call>\n{"name": "bash"} trailing\n</tool_call>',
            MalformedToolCallError,
            "text after the tool call",
        ),
        ("<tool_call>\n[1, 2]\n</tool_call>", MalformedToolCallError, "must be"),
        (
            '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
            UnknownToolError,
            "unknown tool 'rm_rf'; available: bash, python",
        ),
        (
            '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>',
            BadArgumentsError,
            "'command' is a required property",
        ),
        (
            '<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "timeout": "5"}}'
            "\n</tool_call>",
            BadArgumentsError,
            "bash: timeout: '5' is not of type 'integer'",
        ),
        (
            '<tool_call>\n{"name": "bash", "arguments": "not json"}\n</tool_call>',
            BadArgumentsError,
            "not a JSON object",
        ),
        (
            '<tool_call>\n{"name": "bash", "arguments": ["ls"]}\n</tool_call>',
            BadArgumentsError,
            "must be a JSON object",
        ),
    ],
)
def test_hermes_errors(text: str, error: type[ToolCallError], message: str) -> None:
    with pytest.raises(error, match=message):
        parse_tool_calls(text, tools=TOOLS)


def test_too_many_calls_and_the_limit() -> None:
    one = render_tool_call(ToolCall(name="bash", arguments={"command": "ls"}))
    with pytest.raises(TooManyToolCallsError, match="2 tool calls in one turn; at most 1"):
        parse_tool_calls(one + "\n" + one, tools=TOOLS)
    assert len(parse_tool_calls(one + "\n" + one, tools=TOOLS, max_calls=None)) == 2


def test_without_tools_names_are_not_checked() -> None:
    text = '<tool_call>{"name": "anything", "arguments": {"x": 1}}</tool_call>'
    assert parse_tool_calls(text)[0].name == "anything"


def test_errors_share_one_base_and_say_their_kind() -> None:
    kinds = {
        NoToolCallError.kind,
        MalformedToolCallError.kind,
        UnknownToolError.kind,
        BadArgumentsError.kind,
        TooManyToolCallsError.kind,
    }
    assert len(kinds) == 5
    for error in (
        NoToolCallError,
        MalformedToolCallError,
        UnknownToolError,
        BadArgumentsError,
        TooManyToolCallsError,
    ):
        assert issubclass(error, ToolCallError)


def test_qwen3_coder_as_the_model_writes_it() -> None:
    text = (
        "Let me look.\n<tool_call>\n<function=bash>\n<parameter=command>\ngrep -rn "
        "'def parse' src/ | head -20\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert parse_tool_calls(text, "qwen3_coder", TOOLS) == [
        ToolCall(
            name="bash",
            arguments={"command": "grep -rn 'def parse' src/ | head -20", "timeout": 30},
        )
    ]


def test_qwen3_coder_survives_closing_tags_inside_values() -> None:
    code = 'print("</parameter>")\n# </function> </tool_call>\nx = {"a": 1}'
    text = render_tool_call(ToolCall(name="python", arguments={"code": code}), "qwen3_coder")
    assert parse_tool_calls(text, "qwen3_coder", TOOLS)[0].arguments == {"code": code}


def test_qwen3_coder_multiline_value_keeps_inner_newlines() -> None:
    code = "\nfor i in range(3):\n    print(i)\n\n"
    text = render_tool_call(ToolCall(name="python", arguments={"code": code}), "qwen3_coder")
    assert parse_tool_calls(text, "qwen3_coder", TOOLS)[0].arguments["code"] == code


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        (
            "<tool_call>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
            MalformedToolCallError,
            "expected <function=NAME>",
        ),
        (
            "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
            MalformedToolCallError,
            "not closed by </function>",
        ),
        (
            "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</function>\n</tool_call>",
            MalformedToolCallError,
            "<parameter=command> is not closed",
        ),
        (
            "<tool_call>\n<function=bash>\nstray text\n<parameter=command>\nls\n</parameter>\n"
            "</function>\n</tool_call>",
            MalformedToolCallError,
            "text outside",
        ),
        (
            "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n<parameter=command>"
            "\npwd\n</parameter>\n</function>\n</tool_call>",
            BadArgumentsError,
            "given twice",
        ),
        (
            "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout>"
            "\nsoon\n</parameter>\n</function>\n</tool_call>",
            BadArgumentsError,
            "'soon' is not of type 'integer'",
        ),
        ("<tool_call>\n<function=edit>\n</function>\n</tool_call>", UnknownToolError, "'edit'"),
    ],
)
def test_qwen3_coder_errors(text: str, error: type[ToolCallError], message: str) -> None:
    with pytest.raises(error, match=message):
        parse_tool_calls(text, "qwen3_coder", TOOLS)


def test_unknown_format_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("<tool_call>", "xml")  # type: ignore[arg-type]


ARGUMENT_TEXT = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
    | st.sampled_from(["</tool_call>", "</parameter>", "</function>", "{", "}", '"', "\\", "\n"]),
    max_size=12,
).map("".join)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
@given(command=ARGUMENT_TEXT, timeout=st.integers(-(10**9), 10**9))
def test_rendering_through_the_chat_template_and_parsing_round_trips(
    factory_tokenizer: Any, fmt: str, command: str, timeout: int
) -> None:
    arguments = {"command": command, "timeout": timeout}
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": arguments}}
            ],
        },
    ]
    text = factory_tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, tool_call_format=fmt
    )
    action = text.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    assert parse_tool_calls(action, fmt, TOOLS) == [ToolCall(name="bash", arguments=arguments)]
    assert action == render_tool_call(ToolCall(name="bash", arguments=arguments), fmt)
