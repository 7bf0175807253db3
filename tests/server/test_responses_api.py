"""`/v1/responses` through the official openai client (`client.responses.create`), streamed and
not: text input and message lists with `instructions` (the same answer as the chat endpoint on the
same conversation), `text.format` (a JSON schema the answer follows), a function tool (a forced call
becomes a `function_call` item), `previous_response_id` (the stored conversation continues), and
the 400s / 404 of what it does not take; a stored response retrieved (as answered, streamed or
not), its input items listed and paged, deleted, and a cancel refused as OpenAI refuses it for a
response that is not in the background."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.helpers.servers import RunningServer

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_and_messages_answer_as_chat_does(client: OpenAI) -> None:
    out = client.responses.create(model="demo", input="Name a color.", instructions="Be brief.",
                                  max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model="demo", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a color."}])
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    items = client.responses.create(
        model="demo", max_output_tokens=12, temperature=0, instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}])
    assert items.output_text == out.output_text


def test_streamed_events_add_up_to_the_answer(client: OpenAI) -> None:
    kwargs = dict(model="demo", input="Tell me a story.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete"
                          else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item.id for e in events if e.type.startswith("response.output_item.")}
    item_ids |= {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[-1].response.output[0].id}  # one message, one id throughout


def test_text_format_json_schema_is_followed(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}},
              "required": ["color"], "additionalProperties": False}
    out = client.responses.create(
        model="demo", input="A color as JSON.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "color", "schema": schema,
                         "strict": True}})
    assert set(json.loads(out.output_text)) == {"color"}


def test_a_function_call_then_its_output_continue_the_stored_conversation(
    client: OpenAI,
) -> None:
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model="demo", input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice=forced, max_output_tokens=64, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    follow = client.responses.create(
        model="demo", previous_response_id=first.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    chat = client.chat.completions.create(  # the same conversation (tools are given per request)
        model="demo", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert follow.previous_response_id == first.id
    assert follow.output_text == (chat.choices[0].message.content or "")
    streamed = list(client.responses.create(model="demo", input="Weather in Paris?",
                                            tools=[WEATHER], tool_choice=forced,
                                            max_output_tokens=64, temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]


def test_a_follow_up_gets_the_conversation_and_only_its_own_instructions(
    client: OpenAI,
) -> None:
    first = client.responses.create(model="demo", input="Hi", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    follow = client.responses.create(model="demo", input="And then?", instructions="Be kind.",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    chat = client.chat.completions.create(model="demo", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert follow.output_text == chat.choices[0].message.content
    stateless = client.responses.create(model="demo", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    same = client.chat.completions.create(model="demo", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert stateless.output_text == same.choices[0].message.content


def test_what_it_does_not_take_is_refused(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="reasoning"):
        client.responses.create(model="demo", input="Hi", reasoning={"effort": "low"})
    for bad, param in (
        (dict(max_output_tokens=-1), "max_output_tokens"),
        (dict(max_output_tokens=10**6), "max_output_tokens"),
        (dict(include=["reasoning.encrypted_content"]), "include"),
        (dict(tools=[WEATHER | {"defer_loading": True}]), "tools[0]"),
        (dict(tools=[{"type": "web_search"}]), "tools[0]"),
        (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
         "input[0].call_id"),
        (dict(text={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
         "text.format"),
    ):
        with pytest.raises(BadRequestError) as e:
            client.responses.create(model="demo", **({"input": "Hi"} | bad))
        assert e.value.body["param"].startswith(param), (bad, e.value.body)
    assert client.responses.create(model="demo", input="Hi", max_output_tokens=2, tools=[],
                                   include=[], truncation="disabled", user="u",
                                   metadata={"k": "v"}).status in ("completed", "incomplete")
    with pytest.raises(NotFoundError, match="no stored response"):
        client.responses.create(model="demo", input="Hi", previous_response_id="resp_nope")
    kept = client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.create(model="demo", input="Hi", previous_response_id=kept.id)


def kinds_of(events: list) -> list[str]:
    return [e.type for e in events]


def test_an_engine_error_mid_stream_is_response_failed(server: RunningServer,
                                                       client: OpenAI) -> None:
    """The engine fails the request after the stream has started (as SIGTERM's drain does when its
    time is up): the stream ends with an `error` event and `response.failed`, as OpenAI's does;
    the server serves on."""
    stream = client.responses.create(model="demo", input="Tell me a long story.", stream=True,
                                     max_output_tokens=1500, temperature=0)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and kinds_of(events).count(event.type) == 1:
            loop = server.server.loop
            loop.call_soon_threadsafe(server.state.client.fail_all, "the engine went away")
    kinds = kinds_of(events)
    assert kinds[-2:] == ["error", "response.failed"], kinds[-5:]
    assert events[-2].message == "the engine went away"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "the engine went away"
    again = client.responses.create(model="demo", input="hi", max_output_tokens=4)
    assert again.status in ("completed", "incomplete")


def test_a_stored_response_is_retrieved_listed_deleted_and_not_cancelled(client: OpenAI) -> None:
    out = client.responses.create(
        model="demo", instructions="Be brief.", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Name a color."},
               {"role": "assistant", "content": "Blue."},
               {"role": "user", "content": [{"type": "input_text", "text": "Another?"}]}])
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump()
    items = client.responses.input_items.list(out.id, order="asc")
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert [i.content[0].text for i in items.data] == ["Name a color.", "Blue.", "Another?"]
    newest = client.responses.input_items.list(out.id, limit=1)
    assert newest.data[0].content[0].text == "Another?" and newest.has_more
    after = client.responses.input_items.list(out.id, limit=5, after=newest.data[0].id)
    assert [i.content[0].text for i in after.data] == ["Blue.", "Name a color."]
    assert not after.has_more
    with pytest.raises(BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(out.id)
    streamed = list(client.responses.create(model="demo", input="Hi", max_output_tokens=4,
                                            temperature=0, stream=True))
    final = streamed[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    with pytest.raises(BadRequestError, match="'stream' is not supported"):
        client.responses.retrieve(out.id, stream=True)
    client.responses.delete(out.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(out.id)
    unstored = client.responses.create(model="demo", input="Hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(NotFoundError):
        client.responses.input_items.list(unstored.id)
