"""Recipes: the typed configuration of every stage, and the YAML files that fill it (one whole run each: target,
data, head, training, export, decoding, evaluation).

`load_config("tiny")` finds recipes/tiny.yaml (or takes a path), merges it (over its `base:` recipe, if it names
one) over the structured schema (recipes/schema.py; unknown keys fail loudly, listing the valid ones), applies
`key=value` overrides and checks every value (RecipeError naming the key).
"""
from recipes.check import RecipeError
from recipes.load import add_print_config, command_config, config_yaml, list_recipes, load_config, recipe_path
from recipes.schema import Recipe

__all__ = ["Recipe", "RecipeError", "add_print_config", "command_config", "config_yaml", "list_recipes", "load_config",
           "recipe_path"]
