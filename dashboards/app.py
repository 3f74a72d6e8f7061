"""The ranklens dashboard (Streamlit): ``ranklens dashboard`` runs ``streamlit run`` on this file.

The store comes from ``$RANKLENS_STORE``. Pages are the ``page_*.py`` scripts next to this file;
each reads the job picked in the sidebar and its own filters from the URL's query parameters.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from ranklens.dashboards import ui

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="ranklens", layout="wide")
pages = [
    st.Page(str(HERE / script), title=title, url_path=url_path, default=(key == "overview"))
    for key, (script, title, url_path) in ui.PAGES.items()
]
page = st.navigation(pages)
st.sidebar.title("ranklens")
ui.select_job()
ui.auto_refresh()
page.run()
