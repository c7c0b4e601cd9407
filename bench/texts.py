"""The request payloads: realistic English sentences of 8 to 40 words, fixed and ordered.

Encoder requests carry one sentence each; generation prompts are the sentences cut to at most
:data:`PROMPT_WORDS` words, so that they are 10 to 30 tokens long for the benchmark Llama.
"""

SENTENCES: tuple[str, ...] = (
    "The train to Berlin was delayed by twenty minutes this morning.",
    "Could you send me the quarterly report before the meeting on Friday afternoon?",
    "I really enjoyed the film, although the ending felt a little rushed.",
    "The museum opens at nine and closes at six, except on public holidays.",
    "Our new office is on the third floor of the building next to the station, "
    "so please use the side entrance when you visit.",
    "She bought fresh bread, two kinds of cheese and a bottle of wine for dinner.",
    "The customer said the package arrived damaged and asked for a full refund.",
    "Heavy rain is expected across the north of the country tomorrow.",
    "After three years of research, the team finally published its results on how sleep "
    "affects memory in older adults, and the findings surprised many of their colleagues.",
    "Please restart the router if the connection drops again.",
    "The hotel room was clean and quiet, but the breakfast was disappointing.",
    "He has been learning to play the piano since he was seven years old.",
    "The city council voted to build a new bridge across the river, "
    "which should cut travel times for thousands of commuters.",
    "My flight was cancelled, so I spent the night at the airport.",
    "This is by far the best pizza I have ever eaten in this town.",
    "The software update fixes several security issues and improves battery life on older phones.",
    "Children under twelve must be accompanied by an adult at all times while they are "
    "in the swimming pool, and running along the edge of the pool is not allowed.",
    "The price of coffee has risen sharply over the last six months.",
    "I am not sure whether the store is open on Sunday mornings.",
    "The orchestra played three pieces by Mozart and a new work by a young composer.",
    "Farmers in the valley grow apples, pears and cherries on small family plots.",
    "The support team answered my question within ten minutes, which I really appreciated.",
    "When the storm finally passed, the villagers came out of their houses to inspect the "
    "damage, and they found that the old bridge had been washed away by the flood.",
    "Remember to bring your passport and a printed copy of your ticket.",
    "The book tells the story of a young woman who leaves her village to study medicine.",
    "Traffic on the motorway was slow because of roadworks near the exit.",
    "We are looking for an experienced engineer to join our small team in Lisbon.",
    "The doctor recommended more exercise, less sugar and at least seven hours of sleep.",
    "Nobody expected the underdogs to win the final, but they scored twice in the last "
    "ten minutes and lifted the trophy in front of a stunned crowd.",
    "The battery lasts about two days with normal use.",
    "The waiter was rude and the soup was cold.",
    "Scientists have discovered a new species of frog in the rainforest of Ecuador.",
    "The delivery came two days earlier than we expected.",
    "Thank you for your patience while we investigate the problem.",
    "Although the conference was held online this year, more than two thousand people from "
    "forty countries joined the sessions, asked questions in the chat and met in small "
    "groups to discuss the future of renewable energy in their regions.",
    "If you would like to change your booking, please call our customer service line between "
    "eight in the morning and eight in the evening, or write to us and we will reply within "
    "two working days.",
)

PROMPT_WORDS = 6
"""Words kept from a sentence for a generation prompt: 10 to 30 tokens with the benchmark
Llama's small vocabulary (400 byte-level BPE tokens, about 3 tokens a word)."""


def prompts() -> list[str]:
    """The generation prompts: each sentence's first :data:`PROMPT_WORDS` words."""
    return [" ".join(sentence.split()[:PROMPT_WORDS]) for sentence in SENTENCES]


def cycle(texts: list[str] | tuple[str, ...], count: int) -> list[str]:
    """``count`` texts, repeating ``texts`` in order."""
    return [texts[i % len(texts)] for i in range(count)]
