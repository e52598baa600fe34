"""docs/spec.md is rendered from the spec schema (parallelizer/frontend/spec_reference.py):
it must be current, and every field of the schema must say what it is."""
from pathlib import Path

from parallelizer.frontend import spec_reference
from parallelizer.frontend.spec import Spec

DOC = Path(__file__).resolve().parents[3] / "docs" / "spec.md"


def test_docs_spec_md_is_current():
    assert DOC.read_text() == spec_reference.render(), (
        f"docs/spec.md is stale; regenerate it with `{spec_reference.COMMAND}`")


def test_every_field_has_a_description():
    keys = [key for key, field in spec_reference.fields() if not (field.description or "").strip()]
    assert keys == [], f"fields without Field(description=...) in parallelizer/frontend/spec.py: {keys}"


def test_every_key_of_the_schema_is_in_the_reference():
    text = spec_reference.render()
    keys = [key for key, field in spec_reference.fields() if not spec_reference._section(field)]
    assert "| `mesh.tp` |" in text and [k for k in keys if f"| `{k}` |" not in text] == []
    # the defaults shown are the schema's own
    spec = Spec()
    assert f"| `zero_stage` | `{spec.zero_stage}` |" in text
    assert f"| `pipeline.schedule` | `{spec.pipeline.schedule}` |" in text
