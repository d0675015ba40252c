"""Recipes: omegaconf YAML files describing one whole run (target, data, head, training, export, eval).

`load_recipe("tiny")` finds recipes/tiny.yaml (or takes a path), merges it over the structured
schema in recipes.schema (unknown keys fail loudly, listing the valid ones) and applies
`key=value` overrides.
"""
from recipes.schema import Recipe, RecipeError, list_recipes, load_recipe, recipe_path

__all__ = ["Recipe", "RecipeError", "list_recipes", "load_recipe", "recipe_path"]
