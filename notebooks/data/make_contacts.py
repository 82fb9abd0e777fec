"""Writes contacts_train.jsonl and contacts_valid.jsonl: sentences about a person, and the
JSON object a user wants extracted from them. Deterministic (seeded); validation uses names
and cities that never appear in training.

    python notebooks/data/make_contacts.py
"""

import json
import random
from pathlib import Path

NAMES = ["Maria", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jonas", "Chloe", "Mateo", "Nadia", "Felix", "Ines",
         "Kwame", "Sofia", "Lars", "Yuki", "Amara", "Diego", "Hanna", "Ravi", "Elif", "Bruno", "Mei", "Oskar",
         "Zara", "Pablo", "Freya", "Samir", "Ada", "Nils", "Leila", "Hugo", "Anya", "Tariq", "Greta", "Kai"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Berlin", "Cairo", "Mumbai", "Vienna", "Lyon", "Bogota", "Nairobi", "Porto",
          "Seville", "Accra", "Turin", "Bergen", "Osaka", "Lagos", "Quito", "Krakow", "Pune", "Izmir", "Recife",
          "Hanoi", "Malmo", "Dakar", "Cusco", "Aarhus", "Tunis", "Leeds", "Graz", "Beirut", "Nantes"]
SENTENCES = ["{name} is {age} years old and lives in {city}.", "Living in {city}, {name} just turned {age}.",
             "At {age}, {name} moved to {city}.", "{name} ({age}) works in {city}.",
             "Meet {name}, a {age}-year-old from {city}.", "Our new colleague {name} is {age} and based in {city}.",
             "{city} is home to {name}, who is {age}."]
ASKS = ["Extract the name, age and city as JSON: {s}", "Turn this into JSON with name, age and city. {s}",
        "{s}\nGive me this person's name, age and city as a JSON object."]


def record(rng, names, cities):
    person = {"name": rng.choice(names), "age": rng.randint(18, 90), "city": rng.choice(cities)}
    question = rng.choice(ASKS).format(s=rng.choice(SENTENCES).format(**person))
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": json.dumps(person)}]}


def main():
    rng = random.Random(7)
    here = Path(__file__).parent
    train = [record(rng, NAMES[:28], CITIES[:24]) for _ in range(160)]
    valid = [record(rng, NAMES[28:], CITIES[24:]) for _ in range(32)]
    for name, rows in (("contacts_train.jsonl", train), ("contacts_valid.jsonl", valid)):
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
