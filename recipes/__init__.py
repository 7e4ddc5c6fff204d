# Hydra recipes, shipped as the package `dflash_recipes` so that `pkg://dflash_recipes`
# finds them whether the project is installed editable or from a wheel.
