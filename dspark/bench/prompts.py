"""Built-in prompt sets of ``dspark bench``.

``CODE_PROMPTS``: 32 short programming requests (several languages, small self-contained tasks). Code
is the case speculation is expected to shine on (repetitive structure, predictable tokens), so the
bench reports it next to held-out ShareGPT conversation openers (``dspark.train.data.heldout_prompts``),
which the shipped drafter was not trained on either.
"""

from __future__ import annotations

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Implement binary search over a sorted list in Python and return the index or -1.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts how often each word occurs in a text and returns a dict.",
    "Write a Python generator that yields the prime numbers below a given limit.",
    "Implement merge sort in Python.",
    "Write a Python function that flattens an arbitrarily nested list.",
    "Write a Python script that reads a CSV file and prints the average of the 'price' column.",
    "Write a Python dataclass for a 2D point with a method that returns the distance to another point.",
    "Write a Python function that removes duplicates from a list while keeping the original order.",
    "Write a Python decorator that prints how long a function call took.",
    "Write a JavaScript function that debounces another function.",
    "Write a JavaScript function that deep-clones a plain object without using JSON.",
    "Write a TypeScript interface for a user with id, name, email and an optional age, and a function that validates one.",
    "Write a JavaScript function that fetches JSON from a URL with async/await and handles errors.",
    "Implement a linked list in C with functions to push to the front and print the list.",
    "Write a C function that reverses a string in place.",
    "Write a C++ function that returns the k largest elements of a vector using a priority queue.",
    "Write a C++ class for a fixed-size ring buffer of integers.",
    "Write a Rust function that returns the sum of the even numbers in a slice of i32.",
    "Write a Rust struct for a bank account with deposit and withdraw methods that return a Result.",
    "Write a Go function that reverses the words of a sentence.",
    "Write a Go HTTP handler that responds with the current time as JSON.",
    "Write a Java method that checks whether two strings are anagrams of each other.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Write a SQL query that finds duplicate email addresses in a users table.",
    "Write a bash script that counts the lines of every .py file in a directory tree.",
    "Write a regular expression that matches an ISO 8601 date like 2024-03-15, and show it in Python.",
    "Write unit tests with pytest for a function add(a, b) that adds two numbers.",
    "Write a Python function that computes the Levenshtein distance between two strings.",
    "Explain what this code does and fix its bug: def avg(xs): return sum(xs) / len(xs) - 1",
]
