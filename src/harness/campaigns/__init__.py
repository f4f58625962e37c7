"""The campaigns, side by side on the run layer and importing nothing of each other: `controls`
(hand-written perturbations, each naming the gate it must turn red and how) and `mutate`
(generated mutants of the device code, screened by their cubins, scored in Stryker's schema).
They differ only in where their perturbed trees come from and how they report them."""
