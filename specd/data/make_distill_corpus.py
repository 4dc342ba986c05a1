"""Build the prompt corpus for draft-model distillation: distill_prompts.jsonl.

The corpus (~420 prompts) is generated from templates x slot fillers in three
domains: "chat" (explanations, advice, short writing, summaries, comparisons,
everyday questions), "code" (Python/JavaScript/SQL/shell: write a function,
explain a snippet, fix a bug, write tests, translate) and "math" (word problems
with concrete numbers, algebra, unit conversion, logic puzzles, step-by-step
reasoning). Each output line is {"id": "chat-0001", "domain": ..., "prompt": ...}.

The held-out evaluation set is prompts.jsonl (next to this file). It must never
be trained on, so build() asserts that no generated prompt equals a held-out
prompt and that none shares its first 6 words with one (plus a small blocklist
of held-out topics). Every prompt must be 5-60 words and unique.

Stdlib only and deterministic (fixed seeds, one random.Random per domain), so
    python specd/data/make_distill_corpus.py
rewrites distill_prompts.jsonl byte-identically.
"""

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT_PATH = HERE / "prompts.jsonl"
OUT_PATH = HERE / "distill_prompts.jsonl"
SEED = 20240611
# Wordings per topic: each filler goes through this many of its templates, and each random
# generator draws this many times as many prompts (2: ~850 prompts, twice the first corpus).
VARIANTS = 2
MIN_WORDS, MAX_WORDS = 5, 60
# Topics of held-out prompts that must not appear in the distillation corpus at all.
HELDOUT_TOPICS = (
    "palindrome", "fibonacci", "photosynthesis", "black hole", "romeo", "water cycle",
    "green tea", "capital of france", "sky blue", "fizzbuzz", "list comprehension",
    "camping", "autumn leaves", "bakery", "weather and climate", "sleeping better",
    "breakfast", "type hints", "tuple", "merges two sorted", "average speed",
)


# --------------------------------------------------------------------------- helpers

def fill(templates, fillers):
    """Pair each filler with VARIANTS templates, round-robin (fewer if there are fewer);
    fillers are str ({x}) or dicts."""
    out = []
    for i, f in enumerate(fillers):
        slots = f if isinstance(f, dict) else {"x": f}
        for v in range(min(VARIANTS, len(templates))):
            out.append(templates[(i + v) % len(templates)].format(**slots))
    return out


def sample(rng, gen, k):
    """Call gen(rng) until it has produced k * VARIANTS distinct prompts."""
    k *= VARIANTS
    seen = []
    for _ in range(1000):
        p = gen(rng)
        if p not in seen:
            seen.append(p)
        if len(seen) == k:
            return seen
    raise RuntimeError("could not draw %d distinct prompts from %s" % (k, gen.__name__))


def first_words(text, n=6):
    words = [re.sub(r"[^a-z0-9]", "", w) for w in text.lower().split()]
    return tuple(w for w in words if w)[:n]


def norm(text):
    return " ".join(text.lower().split())


# --------------------------------------------------------------------------- chat

EXPLAIN_T = [
    "Explain {x} in simple terms.",
    "Can you explain {x} to a complete beginner?",
    "I've never really understood {x}. Could you explain it briefly?",
    "Give me a short, clear explanation of {x}.",
    "Help me understand {x} using an everyday example.",
    "In a few sentences, explain {x}.",
]
EXPLAIN_F = [
    "how a rainbow forms", "what inflation is", "how compound interest works",
    "how vaccines train the immune system", "the greenhouse effect", "how airplanes stay in the air",
    "why the ocean has tides", "how a refrigerator keeps food cold", "what DNA does in the body",
    "how data travels across the internet", "supply and demand", "how rechargeable batteries store energy",
    "what causes earthquakes", "how the heart pumps blood", "what a credit score is",
    "how GPS figures out your location", "why bread dough rises", "what causes a solar eclipse",
    "how solar panels turn sunlight into electricity", "why the ocean is salty", "how bees make honey",
    "what a stock market index is", "how noise-cancelling headphones work", "what a carbon footprint is",
    "how a microwave oven heats food", "the placebo effect",
]

ADVICE_T = [
    "Give me some practical advice on {x}.",
    "What are a few tips for {x}?",
    "I'm struggling with {x}. What should I try?",
    "What's a good strategy for {x}?",
    "I need help {x}. Where should I start?",
]
ADVICE_F = [
    "staying focused while working from home", "saving money on groceries", "preparing for a job interview",
    "keeping houseplants alive", "training for my first 5K race", "making small talk at parties",
    "organizing a messy closet", "cutting down my screen time", "cooking healthy meals on a tight budget",
    "dealing with a noisy upstairs neighbor", "starting a vegetable garden on a small balcony",
    "managing nerves before giving a presentation", "making friends after moving to a new city",
    "asking for a raise at work", "taking better photos with my phone",
    "staying motivated to exercise in the winter", "keeping my email inbox under control",
    "teaching my dog to walk nicely on a leash", "writing a strong cover letter",
    "being a better listener in conversations",
]

POEM_T = [
    "Write a four-line poem about {x}.",
    "Compose a haiku about {x}.",
    "Write a funny limerick about {x}.",
    "Write a short rhyming poem for kids about {x}.",
]
POEM_F = [
    "a rainy Monday morning", "a cat who hates baths", "the first snowfall of winter", "a lighthouse at night",
    "a forgotten umbrella", "the smell of fresh coffee", "a city bus at rush hour", "a slow garden snail",
    "the last day of summer vacation", "an old red bicycle",
]

MESSAGE_T = [
    "Write a short email {x}.",
    "Draft a friendly text message {x}.",
    "Help me write a brief note {x}.",
    "Compose a polite message {x}.",
]
MESSAGE_F = [
    "thanking a coworker for helping me move apartments", "inviting my neighbors to a small barbecue on Saturday",
    "telling my landlord that the kitchen sink is leaking", "congratulating a friend on her new job",
    "apologizing to a customer for a delayed delivery", "reminding my team about the Thursday deadline",
    "asking a former professor for a letter of recommendation",
    "declining a wedding invitation without hurting feelings", "welcoming a new member to our book club",
    "asking a store about a refund for a broken lamp",
]

SLOGAN_T = ["Come up with a catchy slogan for {x}.", "Suggest three possible slogans for {x}."]
SLOGAN_F = [
    "a neighborhood bike repair shop", "a reusable water bottle brand", "a small-town music festival",
    "a dog-walking service", "a vegetarian food truck",
]
STORY_T = [
    "Write the opening paragraph of a mystery story set in {x}.",
    "Write a 100-word short story that takes place in {x}.",
    "Write a two-sentence scary story set in {x}.",
]
STORY_F = [
    "a library after closing time", "an empty train station during a storm",
    "a mountain cabin with no phone signal", "a busy hospital kitchen", "a space station orbiting Mars",
    "a quiet fishing village",
]
PRODUCT_T = [
    "Write a short product description for {x}.",
    "Write an online listing for {x} that would make people want to buy it.",
]
PRODUCT_F = [
    "a pair of waterproof hiking boots", "a handmade ceramic mug", "a foldable standing desk",
    "a solar-powered phone charger",
]

GRAMMAR_T = [
    'Fix the grammar in this sentence: "{x}"',
    'Correct the mistakes in this sentence and explain each fix: "{x}"',
]
GRAMMAR_F = [
    "Me and him goes to the store every weekends.", "Their going to be late because the bus were delayed.",
    "She don't like when people talks during the movie.", "Its been three year since I seen my cousin.",
    "The informations you gave me was very helpfull.",
]
CONCISE_T = [
    'Make this sentence shorter and clearer: "{x}"',
    'Rewrite this sentence without the unnecessary words: "{x}"',
]
CONCISE_F = [
    "Due to the fact that it was raining outside, we made the decision to stay inside the house.",
    "At this point in time, we are not currently able to process your request.",
    "In my personal opinion, I think that the meeting could have been shorter in length.",
    "The reason why I am writing to you is because I would like to ask a question.",
    "It is absolutely essential and necessary that everyone arrives on time.",
]
FRIENDLY_T = [
    'Rewrite this message so it sounds friendlier: "{x}"',
    'How could I say this more kindly? "{x}"',
]
FRIENDLY_F = [
    "Send me the files by noon.", "Your application is incomplete. Fix it.",
    "Stop leaving dirty dishes in the office sink.", "The meeting moved to 3pm. Don't be late.",
]

PASSAGE_T = [
    "Summarize this paragraph in one sentence:\n\n{x}",
    "What is the main point of this passage?\n\n{x}",
    "Give me a one-line summary of the following text:\n\n{x}",
    "Summarize the following in plain language for a busy reader:\n\n{x}",
]
PASSAGE_F = [
    "The city council voted on Tuesday to extend library hours on weekends. Supporters said students need "
    "quiet places to study, while critics worried about the added staffing costs. The new schedule begins "
    "next month.",
    "Regular walking has been linked to lower blood pressure, better mood and improved sleep. Researchers say "
    "that even twenty minutes a day can make a difference, especially for people who sit most of the day.",
    "Our company will move to a new office building in March. Employees will receive new badges in February, "
    "and parking will be free for the first three months. Please pack personal items before moving day.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. The angle of "
    "the dance shows the direction relative to the sun, and its length tells other bees how far away the "
    "food is.",
    "The software update fixes a problem that caused the app to crash when uploading large photos. It also "
    "adds a dark mode and makes searching faster. Users are encouraged to install it as soon as possible.",
    "Many people assume that goldfish have a three-second memory, but experiments show they can remember "
    "things for months. Goldfish have been trained to respond to sounds, colors and even to push levers "
    "for food.",
    "The museum's new exhibit features more than two hundred ancient coins from around the Mediterranean. "
    "Visitors can use magnifying stations to study the details, and a short film explains how coins were "
    "made by hand.",
    "Remote work gives employees more flexibility and saves commuting time, but some people report feeling "
    "isolated. Companies are experimenting with hybrid schedules that combine a few office days with "
    "working from home.",
]
TOPIC_SUMMARY_T = [
    "Give me a three-sentence summary of {x}.",
    "Briefly summarize {x}.",
    "In a short paragraph, summarize {x}.",
]
TOPIC_SUMMARY_F = [
    "the fable of the tortoise and the hare", "the story of Cinderella", "the history of the printing press",
    "the life of Marie Curie", "the main causes of World War I", "the Apollo 11 moon landing",
    "the story of the Trojan Horse",
]

CHOICE_T = [
    "What are the pros and cons of {a} versus {b}?",
    "Should I choose {a} or {b}? Explain the trade-offs.",
    "Help me decide between {a} and {b}.",
]
CHOICE_F = [
    {"a": "renting an apartment", "b": "buying a house"},
    {"a": "e-books", "b": "paper books"},
    {"a": "taking the train", "b": "flying for a 500 km trip"},
    {"a": "a laptop", "b": "a tablet for college"},
    {"a": "a gas stove", "b": "an induction cooktop"},
    {"a": "LED bulbs", "b": "incandescent bulbs"},
    {"a": "hiking boots", "b": "trail running shoes"},
    {"a": "a debit card", "b": "a credit card for everyday purchases"},
    {"a": "studying alone", "b": "studying in a group"},
    {"a": "working at a startup", "b": "working at a large company"},
]
CONCEPT_T = [
    "Compare {a} and {b} in a few sentences.",
    "What are the key differences between {a} and {b}?",
    "How do {a} and {b} differ?",
    "Explain the difference between {a} and {b} with examples.",
]
CONCEPT_F = [
    {"a": "frogs", "b": "toads"},
    {"a": "alligators", "b": "crocodiles"},
    {"a": "baking soda", "b": "baking powder"},
    {"a": "a hurricane", "b": "a tornado"},
    {"a": "viruses", "b": "bacteria"},
    {"a": "a savings account", "b": "a checking account"},
    {"a": "butter", "b": "margarine"},
    {"a": "introverts", "b": "extroverts"},
    {"a": "a simile", "b": "a metaphor"},
    {"a": "comets", "b": "asteroids"},
]

HOWTO_T = [
    "How do I {x}?",
    "What's the best way to {x}?",
    "Can you walk me through how to {x}?",
    "What steps should I follow to {x}?",
]
HOWTO_F = [
    "remove a coffee stain from a white shirt", "boil an egg so the yolk stays soft", "fix a flat bicycle tire",
    "unclog a bathroom sink without harsh chemicals", "clean a cast iron pan", "pick a ripe avocado at the store",
    "fold a fitted sheet", "defrost frozen chicken safely", "sharpen a kitchen knife at home",
    "set up a simple monthly budget", "jump-start a car with a dead battery",
    "store fresh herbs so they last longer", "get rid of fruit flies in my kitchen",
    "pack fragile dishes for a move", "make a simple tomato sauce from scratch",
    "hang a picture frame so it's level", "clean a sticky laptop keyboard", "descale an electric kettle",
]

WHY_T = [
    "Why {q}?",
    "Can you explain why {e}?",
    "I've always wondered why {e}. What's the reason?",
]
WHY_F = [
    {"q": "do onions make people cry", "e": "onions make people cry"},
    {"q": "does ice float on water", "e": "ice floats on water"},
    {"q": "do we get hiccups", "e": "we get hiccups"},
    {"q": "do cats knead soft blankets", "e": "cats knead soft blankets"},
    {"q": "do our ears pop on airplanes", "e": "our ears pop on airplanes"},
    {"q": "do we yawn when we're tired", "e": "we yawn when we're tired"},
    {"q": "is it colder at the top of a mountain", "e": "it is colder at the top of a mountain"},
    {"q": "do bananas turn brown so quickly", "e": "bananas turn brown so quickly"},
]

RECOMMEND_T = [
    "Suggest {n} {x}.",
    "Can you recommend {n} {x}?",
    "I'm looking for {n} {x}. Any ideas?",
]
RECOMMEND_F = [
    "indoor activities for a rainy day with kids", "board games that are fun with four players",
    "easy dinners that use five ingredients or fewer", "podcasts for learning about history",
    "gift ideas for a coworker who loves gardening", "inexpensive date night ideas",
    "stretches for people who sit at a desk all day", "names for a golden retriever puppy",
    "classic novels that are easy to read", "questions to ask at the end of a job interview",
]


def chat_prompts(rng):
    out = []
    for templates, fillers in [
        (EXPLAIN_T, EXPLAIN_F), (ADVICE_T, ADVICE_F), (POEM_T, POEM_F), (MESSAGE_T, MESSAGE_F),
        (SLOGAN_T, SLOGAN_F), (STORY_T, STORY_F), (PRODUCT_T, PRODUCT_F), (GRAMMAR_T, GRAMMAR_F),
        (CONCISE_T, CONCISE_F), (FRIENDLY_T, FRIENDLY_F), (PASSAGE_T, PASSAGE_F),
        (TOPIC_SUMMARY_T, TOPIC_SUMMARY_F), (CHOICE_T, CHOICE_F), (CONCEPT_T, CONCEPT_F),
        (HOWTO_T, HOWTO_F), (WHY_T, WHY_F),
    ]:
        out += fill(templates, fillers)
    counts = ["three", "four", "five"]
    out += fill(RECOMMEND_T, [{"n": counts[i % 3], "x": x} for i, x in enumerate(RECOMMEND_F)])
    return out


# --------------------------------------------------------------------------- code

PYFUNC_T = [
    "Write a Python function that {x}.",
    "In Python, write a function that {x}.",
    "Implement a Python function that {x}, and show one example call.",
    "Can you write a short Python function that {x}?",
]
PYFUNC_F = [
    "returns the second largest number in a list", "removes duplicates from a list while keeping the original order",
    "converts a temperature from Celsius to Fahrenheit", "flattens a list of lists into a single list",
    "counts the vowels in a string", "returns the factorial of n using recursion",
    "finds the longest word in a sentence", "capitalizes the first letter of every word in a string",
    "splits a list into chunks of size n", "returns True if a given year is a leap year",
    "returns the sum of the digits of an integer", "returns the most common element in a list",
    "generates a random password of a given length", "swaps the keys and values of a dictionary",
    "returns all prime numbers below n", "rotates a list k positions to the right",
    "converts a number of seconds into hours, minutes and seconds", "returns the common elements of two lists",
    "computes the average of a list while ignoring None values",
    "parses a date string like '2024-03-15' into a datetime object",
    "returns the three largest values in a dictionary", "removes all whitespace from a string",
    "groups a list of words by their first letter", "computes the greatest common divisor of two integers",
    "converts a Roman numeral to an integer", "returns the running totals of a list of numbers",
    "converts an integer to binary without using bin()", "validates that a string is a valid IPv4 address",
    "returns the number of days between two dates", "finds all pairs in a list that add up to a target number",
    "truncates a string to n characters and adds '...' if it was cut", "converts a snake_case string to camelCase",
]

JSFUNC_T = [
    "Write a JavaScript function that {x}.",
    "In JavaScript, how would I write a function that {x}?",
    "Implement a small JS function that {x}.",
]
JSFUNC_F = [
    "debounces another function by a given delay", "returns the sum of all numbers in an array",
    "capitalizes the first letter of a string", "removes falsy values from an array",
    "counts how many times a character appears in a string", "deep-clones a plain object",
    "returns a random integer between min and max, inclusive", "formats a number as US dollars with two decimals",
    "groups an array of objects by a given key", "converts a string to kebab-case",
    "returns the unique values of an array", "returns a Promise that resolves after a given number of milliseconds",
    "validates that a password has at least 8 characters and one digit",
    "shuffles an array using the Fisher-Yates algorithm",
]

SQL_T = [
    "Write a SQL query to {x}.",
    "Give me a SQL statement that would {x}.",
    "In SQL, how do I {x}?",
]
SQL_F = [
    "count the customers in each city from a customers table",
    "find employees whose salary is above the company average", "list products that have never been ordered",
    "compute total revenue per month from a sales table",
    "delete duplicate rows from a contacts table but keep the one with the lowest id",
    "find the second highest salary in an employees table",
    "show each customer's name next to the total of all their orders",
    "select all users who signed up in the last 30 days",
    "raise the price of every item in the 'toys' category by 10 percent",
    "find the three best-selling products by quantity", "create a books table with title, author and publication year",
    "show every department with its employee count, including departments with no employees",
    "find customers who have placed more than five orders",
    "calculate the average rating for each movie in a reviews table",
]

SHELL_T = [
    "Write a shell command to {x}.",
    "What bash command would I use to {x}?",
    "How can I {x} from the Linux command line?",
]
SHELL_F = [
    "find all files larger than 100 MB in my home directory", "rename every .jpeg file in a folder to .jpg",
    "show the ten largest directories under /var", "find how many lines in app.log contain the word 'error'",
    "delete .log files older than seven days", "list the five processes using the most memory",
    "compress a folder into a tar.gz archive", "extract a .tar.gz file into a specific directory",
    "replace 'foo' with 'bar' in every .txt file in a directory", "see which process is listening on port 8080",
    "follow the last 50 lines of a log file as it grows",
    "download a file with curl and save it under a different name",
    "print only the duplicate lines in a text file", "check how much free disk space is left",
    "schedule a script to run every day at 2 a.m.",
]

EXPLAIN_CODE_T = [
    "Explain what this {lang} snippet does:\n\n{code}",
    "What does the following {lang} code do?\n\n{code}",
    "Walk me through this {lang} code step by step:\n\n{code}",
    "Can you explain this {lang} code to a beginner?\n\n{code}",
]
EXPLAIN_CODE_F = [
    ("Python", "names = ['Ana', 'Ben', 'Cy']\nages = [31, 25, 40]\nfor name, age in zip(names, ages):\n"
               "    print(f'{name} is {age}')"),
    ("Python", "people.sort(key=lambda p: p['age'], reverse=True)"),
    ("Python", "def total(*args):\n    return sum(args)\n\nprint(total(1, 2, 3))"),
    ("Python", "with open('notes.txt') as f:\n    lines = [line.strip() for line in f if line.strip()]"),
    ("Python", "try:\n    value = int(user_input)\nexcept ValueError:\n    value = 0"),
    ("Python", "a = {1, 2, 3, 4}\nb = {3, 4, 5}\nprint(a & b, a | b, a - b)"),
    ("Python", "if any(n < 0 for n in numbers):\n    raise ValueError('negative number found')"),
    ("Python", "for i, item in enumerate(items, start=1):\n    print(i, item)"),
    ("Python", "from collections import Counter\nprint(Counter('mississippi').most_common(2))"),
    ("Python", "def memo(f):\n    cache = {}\n    def wrapper(n):\n        if n not in cache:\n"
               "            cache[n] = f(n)\n        return cache[n]\n    return wrapper"),
    ("Python", "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)"),
    ("JavaScript", "const total = cart.reduce((sum, item) => sum + item.price * item.qty, 0);"),
    ("JavaScript", "const adults = users.filter(u => u.age >= 18).map(u => u.name);"),
    ("JavaScript", "const { name, email = 'none' } = user;"),
    ("JavaScript", "setTimeout(() => console.log('later'), 0);\nconsole.log('now');"),
    ("JavaScript", "fetch('/api/items')\n  .then(res => res.json())\n  .then(data => console.log(data.length))\n"
                   "  .catch(err => console.error(err));"),
    ("JavaScript", "const counter = (() => {\n  let n = 0;\n  return () => ++n;\n})();"),
    ("SQL", "SELECT city, COUNT(*) AS n\nFROM customers\nGROUP BY city\nHAVING COUNT(*) > 10\nORDER BY n DESC;"),
    ("SQL", "SELECT c.name\nFROM customers c\nLEFT JOIN orders o ON o.customer_id = c.id\nWHERE o.id IS NULL;"),
    ("shell", "find . -name '*.tmp' -mtime +30 -delete"),
    ("shell", "sort access.log | uniq -c | sort -rn | head -5"),
    ("shell", 'for f in *.png; do\n  convert "$f" "${f%.png}.jpg"\ndone'),
]

BUG_T = [
    "This {lang} code should {goal}, but it doesn't. What's wrong?\n\n{code}",
    "This {lang} code has a bug. Can you find and fix it?\n\n{code}",
    "I want this {lang} code to {goal}. Why doesn't it work, and how do I fix it?\n\n{code}",
    "Find the bug in this {lang} snippet and explain the fix:\n\n{code}",
]
BUG_F = [
    ("Python", "print the numbers 1 to 10", "for i in range(1, 10):\n    print(i)"),
    ("Python", "start with an empty list on every call",
     "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
    ("Python", "return the largest number in a list",
     "def largest(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best"),
    ("Python", "remove every even number from the list",
     "nums = [2, 4, 5, 6, 7]\nfor n in nums:\n    if n % 2 == 0:\n        nums.remove(n)"),
    ("Python", "print the user's age next year",
     "age = input('Age: ')\nprint('Next year you will be ' + age + 1)"),
    ("Python", "return the scores in sorted order", "def sort_scores(scores):\n    return scores.sort()"),
    ("Python", "compute the factorial of n", "def fact(n):\n    return n * fact(n - 1)"),
    ("Python", "return True if the word appears anywhere in the text",
     "def contains(text, word):\n    for w in text.split():\n        if w == word:\n            return True\n"
     "        else:\n            return False"),
    ("Python", "say whether the number typed in is positive",
     "n = input('Number: ')\nif n > 0:\n    print('positive')"),
    ("Python", "return the last element of the list", "def last(xs):\n    return xs[len(xs)]"),
    ("Python", "add up all the prices",
     "prices = {'apple': 1.2, 'pear': 0.8}\ntotal = 0\nfor p in prices:\n    total += p"),
    ("JavaScript", "log 0, 1 and 2 after one second",
     "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 1000);\n}"),
    ("JavaScript", "add two numbers typed in by the user",
     "const a = prompt('a');\nconst b = prompt('b');\nconsole.log(a + b);"),
    ("JavaScript", "return the sum of the array",
     "function sum(arr) {\n  let total;\n  for (const x of arr) total += x;\n  return total;\n}"),
    ("JavaScript", "log every element of the array once",
     "for (let i = 0; i <= arr.length; i++) {\n  console.log(arr[i]);\n}"),
    ("JavaScript", "print 'empty' when the array has no items",
     "const items = [];\nif (items == []) {\n  console.log('empty');\n}"),
    ("JavaScript", "sort the numbers from smallest to largest",
     "const nums = [10, 9, 100, 1];\nnums.sort();\nconsole.log(nums);"),
    ("SQL", "list the cities that have more than 10 customers",
     "SELECT city, COUNT(*)\nFROM customers\nWHERE COUNT(*) > 10\nGROUP BY city;"),
    ("SQL", "find the users who have no email address", "SELECT * FROM users WHERE email = NULL;"),
    ("SQL", "show each product name with the total quantity sold",
     "SELECT p.name, SUM(o.qty)\nFROM products p\nJOIN order_items o ON o.product_id = p.id;"),
    ("shell", "copy a file whose name contains a space", 'file="my report.txt"\ncp $file /backup/'),
    ("shell", "print 'big' when count is greater than 10", "count=15\nif [ $count > 10 ]; then\n  echo big\nfi"),
]

PYTEST_T = [
    "Write pytest unit tests for this function:\n\n{x}",
    "Write a few unit tests for this Python code, including edge cases:\n\n{x}",
    "How would you test this function? Write the tests with pytest.\n\n{x}",
]
PYTEST_F = [
    "def clamp(x, low, high):\n    return max(low, min(x, high))",
    "def slugify(title):\n    return '-'.join(title.lower().split())",
    "def safe_divide(a, b):\n    if b == 0:\n        return None\n    return a / b",
    "def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
    "def initials(full_name):\n    return ''.join(p[0].upper() for p in full_name.split())",
    "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]",
    "def median(xs):\n    s = sorted(xs)\n    mid = len(s) // 2\n"
    "    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2",
    "def parse_price(text):\n    return float(text.replace('$', '').replace(',', ''))",
    "class Clicker:\n    def __init__(self):\n        self.n = 0\n\n    def click(self):\n        self.n += 1\n"
    "        return self.n",
    "def celsius_to_f(c):\n    return c * 9 / 5 + 32",
]
JEST_T = [
    "Write Jest tests for this JavaScript function:\n\n{x}",
    "Write unit tests with Jest for this function, covering edge cases:\n\n{x}",
]
JEST_F = [
    "function capitalize(s) {\n  return s.charAt(0).toUpperCase() + s.slice(1);\n}",
    "function isEven(n) {\n  return n % 2 === 0;\n}",
    "function range(start, end) {\n  const out = [];\n  for (let i = start; i < end; i++) out.push(i);\n"
    "  return out;\n}",
    "function mean(nums) {\n  if (nums.length === 0) return 0;\n  return nums.reduce((a, b) => a + b, 0) / nums.length;\n}",
    "function truncate(s, n) {\n  return s.length > n ? s.slice(0, n) + '...' : s;\n}",
]

PY2JS_T = [
    "Rewrite this Python function in JavaScript:\n\n{x}",
    "How would I write this Python code in JavaScript?\n\n{x}",
]
PY2JS_F = [
    "def greet(name):\n    return f'Hello, {name}!'",
    "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
    "def word_lengths(words):\n    return {w: len(w) for w in words}",
    "def total_price(items):\n    return sum(i['price'] * i['qty'] for i in items)",
]
JS2PY_T = [
    "Convert this JavaScript to Python:\n\n{x}",
    "Translate this JavaScript function into idiomatic Python:\n\n{x}",
]
JS2PY_F = [
    "function countdown(n) {\n  for (let i = n; i > 0; i--) console.log(i);\n}",
    "const square = x => x * x;\nconsole.log([1, 2, 3].map(square));",
    "function pluck(objs, key) {\n  return objs.map(o => o[key]);\n}",
    "function isBlank(s) {\n  return s.trim().length === 0;\n}",
]


def code_prompts(rng):
    out = []
    for templates, fillers in [
        (PYFUNC_T, PYFUNC_F), (JSFUNC_T, JSFUNC_F), (SQL_T, SQL_F), (SHELL_T, SHELL_F),
        (PYTEST_T, PYTEST_F), (JEST_T, JEST_F), (PY2JS_T, PY2JS_F), (JS2PY_T, JS2PY_F),
    ]:
        out += fill(templates, fillers)
    out += fill(EXPLAIN_CODE_T, [{"lang": lang, "code": code} for lang, code in EXPLAIN_CODE_F])
    out += fill(BUG_T, [{"lang": lang, "goal": goal, "code": code} for lang, goal, code in BUG_F])
    return out


# --------------------------------------------------------------------------- math

PEOPLE = [("Maya", "she", "her"), ("Liam", "he", "him"), ("Priya", "she", "her"), ("Omar", "he", "him"),
          ("Sofia", "she", "her"), ("Daniel", "he", "him"), ("Aisha", "she", "her"), ("Kenji", "he", "him"),
          ("Elena", "she", "her"), ("Marcus", "he", "him")]
NAMES = [p[0] for p in PEOPLE]


def w_change(r):
    n, pr, _ = r.choice(PEOPLE)
    a, p = r.randint(3, 8), r.randint(2, 6)
    bill = 20 if a * p < 20 else 50
    return f"{n} buys {a} notebooks at ${p} each and pays with a ${bill} bill. How much change does {pr} get?"


def w_boxes(r):
    a, b, d = r.choice([48, 60, 75, 90, 95]), r.choice([4, 6, 8, 12]), r.randint(2, 5)
    return (f"A baker makes {a} muffins a day and packs them in boxes of {b}. How many full boxes can the "
            f"baker fill in {d} days, and how many muffins are left over?")


def w_pages(r):
    n, pr, _ = r.choice(PEOPLE)
    return f"{n} reads {r.choice([12, 15, 18, 25, 30])} pages a day. How many days will {pr} need to finish a {r.choice([240, 320, 350, 410])}-page book?"


def w_recipe(r):
    a, b = r.choice([200, 250, 300, 360]), r.choice([12, 16, 20, 24])
    c = r.choice([b // 2, b * 3 // 2, b * 2, b * 5 // 2, b * 3])
    return f"A recipe uses {a} grams of flour to make {b} cookies. How much flour do you need for {c} cookies?"


def w_sale(r):
    item = r.choice(["jacket", "pair of sneakers", "backpack", "desk lamp"])
    return f"A {item} costs ${r.choice([40, 64, 85, 120, 150])}. It is on sale for {r.choice([15, 20, 25, 30, 40])}% off. What is the sale price?"


def w_savings(r):
    n, _, obj = r.choice(PEOPLE)
    a = r.choice([12, 15, 18, 25])
    return f"{n} saves ${a} every week. How many weeks will it take {obj} to save ${a * r.randint(8, 20) - r.choice([0, 5])} for a new bike?"


def w_garden(r):
    return (f"A rectangular garden is {r.randint(4, 12)} meters wide and {r.randint(13, 30)} meters long. "
            f"What are its area and its perimeter?")


def w_percent_class(r):
    a = r.choice([20, 25, 40, 50, 60, 80])
    pct = r.choice([10, 20, 25, 30, 40, 45, 60, 75])
    while a * pct % 100:
        pct = r.choice([10, 20, 25, 30, 40, 45, 60, 75])
    return f"There are {a} students in a school club, and {pct}% of them play an instrument. How many students play an instrument?"


def w_pizza(r):
    n, _, _ = r.choice(PEOPLE)
    p, k = r.randint(2, 4), r.randint(2, 5)
    e = r.randint(2, max(2, (p * 8) // (k + 1)))
    return (f"{n} orders {p} pizzas, each cut into 8 slices. {n} and {k} friends each eat {e} slices. "
            f"How many slices are left?")


def w_wage(r):
    n, pr, _ = r.choice(PEOPLE)
    return (f"{n} earns ${r.choice([12, 14, 16, 18, 22])} per hour and works {r.choice([15, 20, 25, 32])} hours each week. "
            f"How much does {pr} earn in {r.randint(3, 8)} weeks?")


def w_tank(r):
    rate = r.choice([8, 12, 15, 20, 25])
    return (f"A water tank holds {rate * r.randint(20, 60)} liters. A hose fills it at {rate} liters per minute. "
            f"How many minutes does it take to fill the empty tank?")


def w_tickets(r):
    adults = r.choice(["1 adult", "2 adults"])
    return (f"A movie ticket costs ${r.choice([11, 12, 14])} for adults and ${r.choice([6, 7, 8])} for children. "
            f"How much does a family of {adults} and {r.randint(2, 4)} children pay in total?")


def w_packs(r):
    return (f"A shop sells pencils in packs of {r.choice([6, 8, 10, 12])}. A teacher needs {r.randint(25, 70)} "
            f"pencils for her class. How many packs should she buy, and how many pencils will be spare?")


def a_linear(r):
    a, x, b = r.randint(2, 9), r.randint(-6, 12), r.randint(1, 20)
    eq = f"{a}x + {b} = {a * x + b}"
    return r.choice([f"Solve for x: {eq}.", f"Find x if {eq}. Show each step.",
                     f"What value of x makes {eq} true? Explain your steps."])


def a_system(r):
    x, y = r.randint(1, 15), r.randint(1, 15)
    if r.random() < 0.5:
        return f"Solve the system of equations: x + y = {x + y} and x - y = {x - y}."
    a = r.randint(2, 4)
    return f"Solve this system step by step: {a}x + y = {a * x + y} and x + y = {x + y}."


def a_expand(r):
    return f"Expand and simplify (x + {r.randint(2, 9)})(x - {r.randint(1, 9)})."


def a_factor(r):
    p, q = r.randint(1, 8), r.randint(2, 9)
    return f"Factor the expression x^2 + {p + q}x + {p * q}, and check your answer by expanding it."


def a_simplify(r):
    return f"Simplify {r.randint(2, 6)}(x + {r.randint(2, 9)}) - {r.randint(2, 9)}x + {r.randint(1, 12)}."


def a_function(r):
    return (f"If f(x) = {r.randint(2, 5)}x^2 - {r.randint(1, 9)}x + {r.randint(1, 9)}, what is f({r.randint(-3, 5)})? "
            f"Show your work.")


def a_slope(r):
    x1, y1 = r.randint(-5, 5), r.randint(-5, 5)
    x2, y2 = x1 + r.randint(1, 6), y1 + r.randint(-8, 8)
    return f"Find the slope of the line passing through the points ({x1}, {y1}) and ({x2}, {y2})."


def a_inequality(r):
    return f"Solve the inequality {r.randint(2, 7)}x - {r.randint(1, 9)} > {r.randint(5, 30)} and explain each step."


UNITS = [
    ("miles", "kilometers", [3, 5, 13, 26]), ("kilograms", "pounds", [4, 12, 65, 80]),
    ("cups", "milliliters", [2, 3, 5]), ("inches", "centimeters", [8, 12, 30, 55]),
    ("hours", "seconds", [3, 5, 7]), ("feet", "meters", [6, 10, 250, 1000]),
    ("ounces", "grams", [4, 8, 16]), ("gallons", "liters", [2, 5, 12]),
    ("days", "minutes", [2, 3, 7]), ("square meters", "square feet", [12, 40, 75]),
    ("kilometers per hour", "meters per second", [36, 90, 108]), ("pounds", "kilograms", [10, 150, 200]),
]
UNIT_T = ["Convert {v} {u1} to {u2}.", "How many {u2} are in {v} {u1}?", "What is {v} {u1} in {u2}? Show the calculation."]


def unit_prompts(r):
    out = []
    for i, (u1, u2, vals) in enumerate(UNITS):
        for v in r.sample(vals, 2 if i < 6 else 1):
            t = UNIT_T[len(out) % len(UNIT_T)]
            if u1 == "kilometers per hour":
                t = UNIT_T[0]
            out.append(t.format(v=v, u1=u1, u2=u2))
    out.append(f"Convert {r.choice([59, 77, 86])} degrees Fahrenheit to Celsius, and explain the formula.")
    out.append(f"What is {r.choice([15, 25, 37])} degrees Celsius in Fahrenheit? Show the calculation.")
    return out


ORDER_WORDS = [("older", "oldest", "youngest"), ("taller", "tallest", "shortest"),
               ("faster", "fastest", "slowest"), ("heavier", "heaviest", "lightest")]


def l_order(r):
    a, b, c = r.sample(NAMES, 3)
    comp, top, bottom = r.choice(ORDER_WORDS)
    return f"{a} is {comp} than {b}. {c} is {comp} than {a}. Who is the {top}, and who is the {bottom}?"


ARGUMENTS = [
    "All roses are flowers. Some flowers fade quickly. Therefore, some roses fade quickly.",
    "All squares are rectangles. This shape is a square. Therefore, it is a rectangle.",
    "If it rains, the street gets wet. The street is wet. Therefore, it rained.",
    "No reptiles have fur. A snake is a reptile. Therefore, a snake has no fur.",
    "If I study, I pass the exam. I did not pass the exam. Therefore, I did not study.",
]
ARG_T = ["Is this argument logically valid? {x} Explain your reasoning.",
         "Does the conclusion follow from the premises? {x}"]

ASSIGN_SETS = [("pet", ["a cat", "a dog", "a parrot"]), ("drink", ["tea", "coffee", "juice"]),
               ("sport", ["tennis", "soccer", "swimming"]), ("car", ["a red car", "a blue car", "a white car"])]


def l_assign(r):
    a, b, c = r.sample(NAMES, 3)
    noun, items = r.choice(ASSIGN_SETS)
    p = r.sample(items, 3)
    return (f"{a}, {b} and {c} each have a different favorite {noun}: {', '.join(items[:2])} or {items[2]}. "
            f"{b}'s favorite is {p[1]}. {a}'s favorite is not {p[2]}. What is each person's favorite {noun}?")


def l_sequence(r):
    kind = r.choice(["arith", "geom", "square", "alt"])
    if kind == "arith":
        s, d = r.randint(1, 20), r.randint(3, 11)
        seq = [s + d * i for i in range(5)]
    elif kind == "geom":
        s, q = r.randint(1, 5), r.choice([2, 3])
        seq = [s * q ** i for i in range(5)]
    elif kind == "square":
        s = r.randint(1, 5)
        seq = [(s + i) ** 2 for i in range(5)]
    else:
        s, u, v = r.randint(1, 10), r.randint(2, 6), r.randint(1, 3)
        seq = [s]
        for i in range(4):
            seq.append(seq[-1] + (u if i % 2 == 0 else -v))
    return f"What number comes next in the sequence {', '.join(map(str, seq))}? Explain the pattern."


def l_farm(r):
    ch, co = r.randint(5, 30), r.randint(3, 20)
    return (f"A farmer has chickens and cows. Together they have {ch + co} heads and {2 * ch + 4 * co} legs. "
            f"How many chickens and how many cows are there?")


DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def l_days(r):
    return f"If today is {r.choice(DAYS)}, what day of the week will it be {r.randint(10, 100)} days from now?"


def l_coins(r):
    d, n = r.randint(3, 15), r.randint(3, 15)
    return (f"I have {d + n} coins, all dimes and nickels, worth {10 * d + 5 * n} cents in total. "
            f"How many of each coin do I have?")


def s_marbles(r):
    return (f"A bag has {r.randint(2, 9)} red, {r.randint(2, 9)} blue and {r.randint(2, 9)} green marbles. If you pick "
            f"one at random, what is the probability that it is not blue? Explain step by step.")


def s_average(r):
    return (f"The average of {r.randint(3, 6)} test scores is {r.randint(70, 88)}. After one more test with a score "
            f"of {r.randint(80, 100)}, what is the new average? Think step by step.")


def s_percent(r):
    a = r.choice([2, 4, 5, 8])
    b = a + r.choice([0.5, 1, 1.5, 2])
    return f"The price of a bus ticket went from ${a:.2f} to ${b:.2f}. By what percentage did it increase? Show your reasoning."


def s_dice(r):
    return (f"If you roll two fair six-sided dice, what is the probability that the sum is {r.randint(3, 11)}? "
            f"Explain step by step.")


def s_letters(r):
    return (f"How many different ways can the letters of the word {r.choice(['CAT', 'HOUSE', 'APPLE', 'BOOK', 'LEVEL'])} "
            f"be arranged? Explain your reasoning.")


def s_prime(r):
    return f"Is {r.choice([91, 97, 119, 127, 143, 221])} a prime number? Explain step by step how you checked."


def s_clock(r):
    return (f"At {r.randint(1, 11)}:{r.choice([10, 15, 20, 30, 40, 45]):02d}, what is the angle between the hour and "
            f"minute hands of a clock? Work it out step by step.")


def math_prompts(rng):
    out = []
    for gen in [w_change, w_boxes, w_pages, w_recipe, w_sale, w_savings, w_garden, w_percent_class,
                w_pizza, w_wage, w_tank, w_tickets, w_packs]:
        out += sample(rng, gen, 3)
    for gen, k in [(a_linear, 4), (a_system, 3), (a_expand, 3), (a_factor, 3), (a_simplify, 3),
                   (a_function, 3), (a_slope, 3), (a_inequality, 3)]:
        out += sample(rng, gen, k)
    out += unit_prompts(rng)
    out += sample(rng, l_order, 4)
    out += fill(ARG_T, ARGUMENTS)
    for gen, k in [(l_assign, 4), (l_sequence, 4), (l_farm, 2), (l_days, 2), (l_coins, 2),
                   (s_marbles, 2), (s_average, 2), (s_percent, 2), (s_dice, 2), (s_letters, 2),
                   (s_prime, 2), (s_clock, 1)]:
        out += sample(rng, gen, k)
    return out


# --------------------------------------------------------------------------- build

def load_heldout():
    prompts = []
    with open(HELDOUT_PATH, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                prompts.append("\n".join(m["content"] for m in rec["messages"] if m["role"] == "user"))
    return prompts


def check(records, heldout):
    held_norm = {norm(p) for p in heldout}
    held_heads = {first_words(p) for p in heldout}
    seen = set()
    for rec in records:
        p = rec["prompt"]
        n = len(p.split())
        assert MIN_WORDS <= n <= MAX_WORDS, f"{rec['id']}: {n} words: {p!r}"
        assert p not in heldout and norm(p) not in held_norm, f"{rec['id']} duplicates a held-out prompt: {p!r}"
        assert first_words(p) not in held_heads, f"{rec['id']} shares its first 6 words with a held-out prompt: {p!r}"
        low = p.lower()
        for topic in HELDOUT_TOPICS:
            assert topic not in low, f"{rec['id']} mentions held-out topic {topic!r}: {p!r}"
        assert norm(p) not in seen, f"{rec['id']} is a duplicate: {p!r}"
        seen.add(norm(p))


def build():
    records = []
    for i, (domain, make) in enumerate([("chat", chat_prompts), ("code", code_prompts), ("math", math_prompts)]):
        rng = random.Random(SEED + i)
        prompts = make(rng)
        rng.shuffle(prompts)
        records += [{"id": f"{domain}-{j:04d}", "domain": domain, "prompt": p}
                    for j, p in enumerate(prompts, start=1)]
    check(records, load_heldout())
    return records


def main():
    records = build()
    with open(OUT_PATH, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    counts = {}
    for rec in records:
        counts[rec["domain"]] = counts.get(rec["domain"], 0) + 1
    print(f"wrote {len(records)} prompts to {OUT_PATH.name}: {counts}")


if __name__ == "__main__":
    main()
