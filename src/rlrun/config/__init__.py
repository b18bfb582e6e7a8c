"""The one typed config tree (schema: dataclasses whose fields are the flags), its reflection (fields: every
field by flag name, coercion, redaction of secrets) and the cross-field checks run before anything starts
(validation).

May import runtime/ and algo/ (validation checks the algorithm settings), nothing above.
"""
