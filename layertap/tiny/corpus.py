"""The small built-in text the tiny tokenizer is trained on.

Mixed prose, chat turns, Python and JSON tool calls, so that every kind of text the tests and the demo
feed through the tiny models gets merges of its own (a tool call should not cost one token per byte).
It is fixed text: changing it changes the tokenizer, and so every tiny model's vocabulary.
"""

PROSE = """\
The river ran slowly past the old mill, and the children sat on the wall to watch the water.
In the morning the market opened early; farmers brought apples, bread, cheese and fresh eggs.
A good question is often more useful than a quick answer, because it shows what we do not know.
She opened the window, looked at the grey sky, and decided that the walk could wait until noon.
The library was quiet except for the sound of pages turning and the soft hum of the lamps.
When the train arrived at the station, the passengers stepped out into the cold evening air.
Learning a new language takes time: you read, you listen, you make mistakes, and you try again.
The weather today is cloudy with a chance of rain in the afternoon and light wind from the west.
He wrote a short letter to his sister, thanking her for the book and asking about her garden.
Numbers such as 3, 14, 2024, 0.5 and 1,000,000 appear in reports, tables and scientific papers.
The committee will meet on Monday at 10:30 to discuss the budget for the next financial year.
Please summarise the following text in three sentences and list the main points as bullets.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many days are there in a leap year? There are 366 days in a leap year, one more than usual.
Can you explain how a neural network learns? It adjusts its weights to reduce the error on examples.
The model reads the prompt, computes hidden states for every token, and predicts the next word.
Speculative decoding uses a small draft model to propose tokens that the large model then checks.
Thank you for your help! You are welcome; let me know if there is anything else I can do.
I think the answer is correct, but we should check the edge cases before we ship the change.
First, preheat the oven. Second, mix the flour and the sugar. Third, bake for twenty minutes.
It was the best of times and the worst of times, and nobody could agree which one it was.
The data was collected over six months from twelve sites across the north of the country.
"""

STORY = """\
Once upon a time there was a small town by the sea, where the people worked hard and told long stories.
Every evening the fishermen came back with their boats full, and their families waited for them on the shore.
One day a stranger arrived with a heavy bag and asked where he could find a room for the night.
Nobody knew who he was or where he had come from, but the owner of the inn gave him a warm meal.
The next morning he opened his bag and showed them maps, instruments and notebooks full of drawings.
"I am looking for the lighthouse that was built here a hundred years ago," he said to the owner.
The owner laughed and said that the lighthouse had fallen into the sea during a storm long before.
The stranger was not surprised. He said that he only wanted to see the place where it had stood.
So they walked together along the cliffs, talking about the history of the town and its people.
When they reached the end of the path, they found the old stones, covered with grass and flowers.
The stranger took out his notebook and started to draw, while the wind blew from the water.
Years later, the people of the town still remembered the visitor who drew the stones of the lighthouse.
Important information should be written clearly, checked carefully, and shared with everyone involved.
Science depends on measurement, experiment and the honest reporting of results, including failures.
Computers process information by following instructions, step by step, millions of times per second.
The government announced new rules for energy, transport, health and education in the spring.
Students should read the chapter, answer the questions at the end, and prepare for the next lesson.
The system failed because the server ran out of memory while processing a very large request.
To fix the problem, restart the service, check the logs, and increase the limit in the configuration file.
Our team found that the results were consistent across different datasets, models and random seeds.
"""

CHAT = """\
User: Hello! Could you help me plan a trip to Rome for three days?
Assistant: Of course. On the first day, visit the Colosseum and the Forum. On the second day,
see the Vatican Museums and St Peter's Basilica. On the third day, walk through Trastevere.
User: What is the weather like in Rome in April?
Assistant: April in Rome is usually mild, with temperatures between 10 and 20 degrees Celsius.
User: Write a haiku about the sea.
Assistant: Grey waves fold and break / salt wind carries the gull's cry / the tide keeps its time.
System: You are a helpful assistant. Answer briefly and use tools when they are needed.
User: What time is it in Tokyo right now?
Assistant: I will look that up with the get_time tool.
Tool: {"timezone": "Asia/Tokyo", "time": "2024-05-01T14:03:00+09:00"}
Assistant: It is 14:03 in Tokyo right now.
"""

CODE = '''\
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


import json
import os
from pathlib import Path


def load_config(path: str) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print(f"odd: {i}")

x = torch.zeros(4, 64, dtype=torch.float32)
y = model(input_ids=x, output_hidden_states=True)
assert y.hidden_states[0].shape == (1, 4, 64)
return {"status": "ok", "count": len(items), "items": items}
'''

JSON = """\
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "get_weather", "arguments": {"city": "London", "unit": "fahrenheit"}}
{"name": "search", "arguments": {"query": "best pizza in Naples", "limit": 5}}
{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}
{"name": "calculator", "arguments": {"expression": "(12 + 30) * 2"}}
{"name": "send_email", "arguments": {"to": "alice@example.com", "subject": "Meeting", "body": "See you at 3pm."}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search", "description": "Search the web for a query",
"parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
"required": ["query"]}}}
{"temperature": 18.5, "condition": "partly cloudy", "humidity": 0.62, "wind_kph": 12}
{"results": [{"title": "Da Michele", "url": "https://example.com/michele", "rating": 4.7}]}
{"id": "call_0", "role": "tool", "content": "{\\"result\\": 84}", "tool_call_id": "call_0"}
[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"},
{"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Berlin\\"}"}}]}]
{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "seq_len": 3, "ok": true, "error": null}
"""

MULTILINGUAL = """\
Bonjour, comment ça va ? Très bien, merci. Où est la gare ?
Guten Tag! Wie geht es Ihnen? Mir geht es gut, danke schön.
¿Dónde está la biblioteca? Está al lado del museo.
Привет, как дела? Хорошо, спасибо.
你好，世界。今天天气很好。
こんにちは、元気ですか。
café, naïve, façade, über, smörgåsbord, 🙂 👍 → ≤ ≥ ∑ π ∞
"""

CORPUS: tuple[str, ...] = (PROSE, STORY, CHAT, CODE, JSON, MULTILINGUAL)
