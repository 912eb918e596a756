"""Batches and dependencies: the block, ``after=``, what an ending sets off, their rows
and what operators read of them (SPEC "Batches and dependencies")."""
